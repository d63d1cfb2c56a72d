# The diloco image: `diloco syncer ...` and `diloco learner ...` (CPU only), run by
# docker-compose.yml and the Helm chart.
#
#   docker build -t ghcr.io/decoupled-diloco/diloco:0.1.0 .
#
# It runs as UID/GID 10001 and works with a read-only root filesystem: state goes to
# /var/lib/diloco (mount a volume there), caches to $HOME=/tmp (mount a tmpfs there).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# torch first, in its own layer: it is by far the largest and changes least often.
# The project's machines get torch==2.13.0 from a local wheel through their pip config;
# a Docker build has no such config, so the CPU build comes from PyTorch's own index
# (PyPI's default torch wheel would pull in the CUDA libraries).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY diloco diloco
COPY services services
COPY learner learner
COPY syncer syncer
COPY localcluster localcluster
COPY integrations integrations
# The planner is no service, but the package pip installs maps it (pyproject.toml).
COPY planner planner
# The installed 2.13.0+cpu satisfies the torch==2.13.0 pin, so pip keeps it. The
# sources are not needed once installed; each subcommand's --help imports its module,
# so a broken install fails the build rather than the first container.
RUN pip install -c constraints.txt . \
    && cd / && rm -rf /src \
    && diloco syncer --help >/dev/null \
    && diloco learner --help >/dev/null \
    && torchrun --help >/dev/null

# A named volume mounted on /var/lib/diloco (or /etc/diloco/tls, where compose's `certs`
# service writes certificates) starts as a copy of this folder, owner included, so the
# non-root user can write there.
RUN groupadd --gid 10001 diloco \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin diloco \
    && mkdir -p /var/lib/diloco /etc/diloco/tls \
    && chown 10001:10001 /var/lib/diloco /etc/diloco/tls
USER 10001:10001
# Relative state paths (run.state_dir defaults to .diloco) land on the volume too.
WORKDIR /var/lib/diloco

# 50051: a syncer shard's gRPC port; 9100: /metrics of any process.
EXPOSE 50051 9100
ENTRYPOINT ["diloco"]
CMD ["--help"]
