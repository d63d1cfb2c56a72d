"""The operator's subcommands of `diloco` (diloco/cli.py dispatches them): status, export,
config and certs. Each provides `add_arguments(parser)` and `run(args) -> int`."""
