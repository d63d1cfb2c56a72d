"""What `from diloco import ...` gives a user's script: every public name resolves, a script
loads the cluster config it was given (to find its learner's index, say), and a bad one is the
public ConfigError."""
import pytest

import diloco
from diloco.services.contract.config import dump_config
from tests.cluster_config import tiny_cluster


@pytest.mark.parametrize("name", diloco.__all__)
def test_every_public_name_resolves(name):
    assert getattr(diloco, name) is not None


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'services'"):
        diloco.__getattr__("services")


def test_a_script_loads_its_cluster_config_and_finds_its_learners_index(tmp_path):
    written = tiny_cluster(tmp_path, shards=1, learners=3)
    (tmp_path / "cluster.yaml").write_text(dump_config(written))
    cfg = diloco.load_config(tmp_path / "cluster.yaml")
    assert isinstance(cfg, diloco.Config) and cfg == written
    assert [learner.id for learner in cfg.learners].index(written.learners[2].id) == 2


def test_a_bad_config_is_the_public_config_error(tmp_path):
    (tmp_path / "cluster.yaml").write_text("sync: {fragments: 0}\n")
    with pytest.raises(diloco.ConfigError, match="sync.fragments"):
        diloco.load_config(tmp_path / "cluster.yaml")
