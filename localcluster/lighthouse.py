"""torchft's lighthouse for one island of replica groups in a local cluster (the membership
service that decides which groups are in each step: learner/island/replica_groups.py). Like the
harness's other processes it dies with the harness: the kernel's parent-death signal outlives
the exec into torchft's own `torchft_lighthouse`.

    python -m diloco.localcluster.lighthouse [torchft_lighthouse's arguments]
"""
import os
import shutil
import sys

from diloco.services.process import die_with_parent

die_with_parent()
binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or shutil.which("torchft_lighthouse")
if binary is None:
    sys.exit("torchft_lighthouse not found: install torchft (pip install -e .)")
os.execv(binary, [binary, *sys.argv[1:]])
