"""torchrun for a harness's job (`diloco sim --mode dp`): like the harness's other processes it
dies with the harness, and its workers die with it.

    python -m diloco.localcluster.torchrun [torchrun's arguments]
"""
import os

from diloco.services.process import DIE_WITH_PARENT_ENV, die_with_parent

die_with_parent()
os.environ[DIE_WITH_PARENT_ENV] = str(os.getpid())  # the workers' parent is this process

from torch.distributed.run import main  # noqa: E402

main()
