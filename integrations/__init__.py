"""Adapters between Decoupled DiLoCo and other training libraries (diloco.integrations.*);
each needs its library's optional extra, e.g. `pip install 'decoupled-diloco[hf]'`."""
