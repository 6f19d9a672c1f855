from dataclasses import dataclass, field
from typing import Literal

import pytest

from ovpipe.config import HASHED_UNLESS_DEFAULT, ConfigError, config_hash, config_json, load_config


@dataclass
class Inner:
    k: int = 10


@dataclass
class Cfg:
    seq_len: int = 8192
    mode: Literal["a", "b"] = "a"
    ratio: float = 0.5
    names: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)
    path: str | None = None

    def __post_init__(self):
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {self.seq_len}")


def test_yaml_roundtrip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seq_len: 4096\nmode: b\nratio: 1\nnames: [x, y]\ninner: {k: 3}\n")
    cfg = load_config(Cfg, p)
    assert cfg == Cfg(seq_len=4096, mode="b", ratio=1.0, names=["x", "y"], inner=Inner(3))


def test_unknown_field_names_it_and_allowed_fields(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seq_lenn: 4096\n")
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, p)
    msg = str(e.value)
    assert "seq_lenn" in msg and "seq_len" in msg and "ratio" in msg and str(p) in msg


@pytest.mark.parametrize("data, needle", [
    ({"seq_len": "big"}, "seq_len"),
    ({"seq_len": True}, "seq_len"),
    ({"mode": "c"}, "mode"),
    ({"names": {"a": 1}}, "names"),
    ({"names": 3}, r"names\[0\]: expected a string"),
    ({"inner": {"kk": 1}}, "kk"),
    ({"inner": {"k": 1.5}}, "inner.k"),
    ({"seq_len": -1}, "seq_len must be > 0"),
])
def test_bad_values_fail_naming_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(Cfg, data)


def test_a_scalar_for_a_list_field_is_a_one_item_list():
    assert load_config(Cfg, {"names": "x"}).names == ["x"]
    assert load_config(Cfg, None, {"names": "/data/x.parquet"}).names == ["/data/x.parquet"]


def test_a_typo_gets_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean 'seq_len'\?"):
        load_config(Cfg, {"seq_lne": 1})


def test_set_values_are_reported_as_set_not_as_the_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("mode: b\n")
    for overrides, needle in [({"seq_len": "big"}, "--set seq_len: expected an integer"), ({"seq_len": -1}, "--set seq_len: seq_len must"),
                              ({"seq_lne": 1}, "--set seq_lne: unknown field")]:
        with pytest.raises(ConfigError) as e:
            load_config(Cfg, p, overrides)
        assert str(e.value).startswith(needle), str(e.value)
        assert str(p) not in str(e.value)
    with pytest.raises(ConfigError, match=f"^{p}.mode"):       # a bad value from the file is still the file's
        p.write_text("mode: c\n")
        load_config(Cfg, p, {"seq_len": 8})


def test_hash_changes_with_config():
    assert config_hash(Cfg()) == config_hash(Cfg())
    assert config_hash(Cfg()) != config_hash(Cfg(seq_len=4096))


@dataclass
class CfgLater(Cfg):   # Cfg with two fields added after runs of it exist
    count_for: Literal["x", "y"] = field(default="x", metadata=HASHED_UNLESS_DEFAULT)
    buffers: list[int] = field(default_factory=lambda: [1, 2], metadata=HASHED_UNLESS_DEFAULT)


def test_a_field_hashed_unless_default_keeps_the_hash_of_runs_made_before_it():
    assert config_hash(CfgLater()) == config_hash(Cfg())
    assert config_hash(CfgLater(seq_len=4096)) == config_hash(Cfg(seq_len=4096))
    assert config_hash(CfgLater(count_for="y")) != config_hash(Cfg())
    assert config_hash(CfgLater(buffers=[3])) != config_hash(Cfg())
    assert config_hash(CfgLater(count_for="y")) != config_hash(CfgLater(buffers=[3]))
    assert config_hash(load_config(CfgLater, {"count_for": "x", "buffers": [1, 2]})) == config_hash(Cfg())
    assert '"count_for": "x"' in config_json(CfgLater())      # still saved in config.json


def test_cli_rejects_bad_config_before_work(tmp_path, capsys):
    from ovpipe.cli import main

    cfg = tmp_path / "ingest.yaml"
    cfg.write_text("inputs: ['x.tar']\nverifyy: full\n")
    rc = main(["ingest", "--config", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "verifyy" in err and "allowed fields" in err
    assert not (tmp_path / "run").exists()


def test_yaml_syntax_error_is_a_config_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seq_len: [4096\n")
    with pytest.raises(ConfigError, match=r"not valid YAML .*line \d+, column \d+"):
        load_config(Cfg, p)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Cfg, tmp_path / "nope.yaml")


@dataclass
class Ranged:
    n: int = 1
    p: float = 0.5
    opt: int | None = None

    def __post_init__(self):
        from ovpipe.config import check_range

        check_range(self, "n", 1)
        check_range(self, "p", 0, 1, lo_open=True)
        check_range(self, "opt", 0)


@pytest.mark.parametrize("data, needle", [
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"p": 0}, "p must be > 0"),
    ({"p": 1.5}, "p must be <= 1"),
    ({"p": float("inf")}, "p must be a finite number"),
    ({"opt": -1}, "opt must be >= 0"),
])
def test_check_range_names_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(Ranged, data)
    assert load_config(Ranged, {"opt": None}) == Ranged()


def test_an_exponent_without_a_dot_is_a_number_in_the_yaml_and_in_set(tmp_path):
    """YAML 1.1 (PyYAML) reads `1e-4` as a string; configs and `--set` read YAML 1.2's floats, so a learning rate
    written as everywhere else is a number. Integers, words and the rest read as before."""
    from ovpipe.cli import _parse_set
    from ovpipe.config import yaml_load

    p = tmp_path / "c.yaml"
    p.write_text("ratio: 1e-4\nnames: [1e3x, e5]\n")
    cfg = load_config(Cfg, p, _parse_set(["seq_len=4096"]))
    assert (cfg.ratio, cfg.names, cfg.seq_len) == (1e-4, ["1e3x", "e5"], 4096)
    assert load_config(Cfg, None, _parse_set(["ratio=3E-2"])).ratio == 0.03
    assert [yaml_load(t) for t in ("1e-4", "-2e3", ".5", "1.0e-4", "7", "1_000", "0x10", "1e", "abc")] == \
        [1e-4, -2000.0, 0.5, 1e-4, 7, 1000, 16, "1e", "abc"]
    assert isinstance(yaml_load("7"), int)
