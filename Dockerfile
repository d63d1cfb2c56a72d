# The diloco image: `diloco syncer ...` and `diloco learner ...` (CPU only), run by
# docker-compose.yml and the Helm chart.
#
#   scripts/fill-wheelhouse.sh                     # every wheel, into wheelhouse/
#   docker build -t ghcr.io/decoupled-diloco/diloco:0.1.0 .
#   docker build --build-arg BASE_IMAGE=diloco-base:bookworm ...   # no registry:
#                                                  # scripts/make-base-images.sh makes that base
#
# The build needs no network: pip installs from wheelhouse/ only. BASE_IMAGE is any Debian-like
# image with Python 3.11 at python3 (pip comes from the wheelhouse).
#
# It runs as UID/GID 10001 and works with a read-only root filesystem: state goes to
# /var/lib/diloco (mount a volume there), caches to $HOME=/tmp (mount a tmpfs there).
ARG BASE_IMAGE=python:3.11-slim

# The dependencies first, into a virtual environment, in a stage whose layers change only with
# the pins (constraints.txt, pyproject.toml) and the wheelhouse: a change of the sources alone
# rebuilds in seconds and leaves the image's largest layer as it was.
FROM ${BASE_IMAGE} AS dependencies
WORKDIR /src
COPY wheelhouse/ wheelhouse/
COPY constraints.txt pyproject.toml ./
# torch==2.13.0 of constraints.txt: the wheelhouse holds only its CPU build. Not needed at run
# time and a fifth of the image: torch's C++ headers, its test binaries (torch_shm_manager is
# no test) and its tests.
RUN python3 -m venv --without-pip /opt/diloco \
    && python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
       > dependencies.txt \
    && pip_wheel=$(echo wheelhouse/pip-*.whl) \
    && /opt/diloco/bin/python "$pip_wheel/pip" install --quiet --no-index \
       --find-links wheelhouse --no-compile -c constraints.txt -r dependencies.txt \
    && site=$(/opt/diloco/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && rm -rf "$site/torch/include" "$site/torch/test" \
    && find "$site/torch/bin" -mindepth 1 ! -name torch_shm_manager -delete

# The package as a wheel, beside pip's own for the final stage (which has no wheelhouse).
# One COPY: .dockerignore lets in only the wheelhouse and what `pip install .` reads.
FROM dependencies AS package
COPY . .
RUN pip_wheel=$(echo wheelhouse/pip-*.whl) \
    && /opt/diloco/bin/python "$pip_wheel/pip" wheel --quiet --no-index \
       --find-links wheelhouse --no-deps -c constraints.txt --wheel-dir /dist . \
    && cp -r "$pip_wheel" /dist/pip.whl

# The image less the package: its layers too are the same from one change of the sources to the next.
FROM ${BASE_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/diloco/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp

# A named volume mounted on /var/lib/diloco (or /etc/diloco/tls, where compose's `certs`
# service writes certificates) starts as a copy of this folder, owner included, so the
# non-root user can write there.
RUN groupadd --gid 10001 diloco \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin diloco \
    && mkdir -p /var/lib/diloco /etc/diloco/tls \
    && chown 10001:10001 /var/lib/diloco /etc/diloco/tls
COPY --from=dependencies /opt/diloco /opt/diloco

FROM runtime
COPY --from=package /dist /tmp/dist
# Importing each service's module (and torchrun's) from outside the sources, a broken install
# fails the build, not a container.
RUN /opt/diloco/bin/python /tmp/dist/pip.whl/pip install --quiet --no-index --no-deps --no-compile \
       /tmp/dist/decoupled_diloco-*.whl \
    && rm -rf /tmp/dist \
    && cd / && /opt/diloco/bin/python -c "import diloco.syncer.main, diloco.learner.trainer.main, torch.distributed.run"
USER 10001:10001
# Relative state paths (run.state_dir defaults to .diloco) land on the volume too.
WORKDIR /var/lib/diloco

# 50051: a syncer shard's gRPC port; 9100: /metrics of any process.
EXPOSE 50051 9100
ENTRYPOINT ["diloco"]
CMD ["--help"]
