"""The CLI knows the job: --config from a TOML file or python:module:attr; --json on ls and verify."""

import glob
import json
import subprocess
import sys

import preloaded
import pytest
from conftest import settle
from test_save_load import flip_byte, save

from tiered_dcp import Tier, TieredConfig
from tiered_dcp.cli.jobconfig import config_from_dict, load_job_config

TOML = """namespace = "run"
replication_factor = 1
peer_timeout = 30.0

[[tiers]]
path = "{root}/ram/{{node}}"
every = 1
keep = 2

[[tiers]]
path = "{root}/ssd/{{node}}"
every = 2
keep = 3

[[tiers]]
path = "{root}/bucket"
every = 4
compression = "zstd"
shared = true
"""


def write_toml(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text(TOML.format(root=tmp_path))
    return str(path)


def cli(*args, check=True, cwd=None):
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_toml_gives_the_same_config_as_python(tmp_path, tiers3):
    cfg = load_job_config(write_toml(tmp_path))
    assert cfg == TieredConfig("run", tiers3.tiers, peer_timeout=30.0)
    gcs = config_from_dict(
        {"namespace": "x", "tiers": [{"path": "gs://b/c", "storage_options": {"endpoint_url": "http://h"}}]}
    )
    assert gcs.tiers == [Tier("gs://b/c", storage_options={"endpoint_url": "http://h"})]


@pytest.mark.parametrize(
    "text, message",
    [
        ('namespace = "x"\n', "at least one [[tiers]]"),
        ('namespace = "x"\nreplication = 2\n[[tiers]]\npath = "/a"\n', "unknown key(s) ['replication']"),
        ('namespace = "x"\n[[tiers]]\npath = "/a"\nkeeps = 2\n', "[[tiers]] #1: unknown key(s) ['keeps']"),
        ('namespace = "x"\n[[tiers]]\nevery = 2\n', "[[tiers]] #1: Tier needs path"),
        ('[[tiers]]\npath = "/a"\n', "TieredConfig needs namespace"),
        ('namespace = "x"\n[[tiers]]\npath = "/a"\nevery = 0\n', "every=0 must be an integer >= 1"),
        ('namespace = "x"\ntier_timeout = -1\n[[tiers]]\npath = "/a"\n', "tier_timeout=-1 must be"),
        # a backend package not installed (s3fs is, with the test tools: adlfs is not)
        ('namespace = "x"\n[[tiers]]\npath = "az://bucket/ckpt"\n', "pip install adlfs"),
        ("namespace = \n", "not valid TOML"),
    ],
)
def test_bad_config_files_say_what_to_change(tmp_path, text, message):
    """Every error names the file (and the tier table it is about) and what is wrong."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_job_config(str(path))
    assert message in str(e.value) and str(e.value).startswith(str(path))
    r = cli("ls", "--config", str(path), check=False)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_a_toml_file_takes_every_field_of_the_dataclasses(tmp_path):
    path = tmp_path / "all.toml"
    path.write_text(
        'namespace = "all"\nreplication_factor = 2\nreplication_jump = 1\ndedup = true\n'
        "peer_timeout = 30.0\ntier_timeout = 5.0\nwriter_drain_timeout = 60.0\n"
        'on_nonfinite = "raise"\nfailure_domain = "RACK"\n'
        '[[tiers]]\npath = "/a/{node}"\nevery = 1\nkeep = 2\n'
        'compression = "zstd"\nshared = false\n[tiers.storage_options]\n'
    )
    assert load_job_config(str(path)) == TieredConfig(
        "all",
        [Tier("/a/{node}", keep=2, compression="zstd", shared=False)],
        replication_factor=2,
        dedup=True,
        peer_timeout=30.0,
        tier_timeout=5.0,
        writer_drain_timeout=60.0,
        on_nonfinite="raise",
        failure_domain="RACK",
    )


def test_a_python_file_given_as_toml_is_named_with_the_form_to_use(tmp_path):
    path = tmp_path / "train_cfg.py"
    path.write_text("CONFIG = 1\n")  # valid TOML, too
    with pytest.raises(ValueError, match=r"train_cfg.py: a Python file .* python:train_cfg:CONFIG"):
        load_job_config(str(path))


HIDE_S3FS = """
import importlib.machinery, sys
class Hide(importlib.machinery.PathFinder):  # s3fs is not installed, as far as imports can tell
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "s3fs" else super().find_spec(name, path, target)
sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hide
import pytest
from tiered_dcp import Tier
"""


def test_a_tier_whose_backend_is_not_installed_is_refused_when_configured():
    """A tier whose backend package is missing is refused at once, naming the package, not
    when a save's writer process first opens it (where only its log would say why). s3fs is
    hidden from a fresh process's imports (the test tools install it)."""
    check = """
with pytest.raises(ValueError, match=r"Tier\\('s3://b/ckpt'\\): .*pip install s3fs"):
    Tier("s3://b/ckpt")
with pytest.raises(ValueError, match="pip install s3fs"):
    Tier("simplecache::s3://b/ckpt")  # a chained fsspec URL: every protocol in it
"""
    r = subprocess.run([sys.executable, "-c", HIDE_S3FS + check], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError, match="no storage backend for URL scheme 'nosuch'"):
        Tier("nosuch://b/ckpt")
    assert Tier("memory://ckpt").is_shared and Tier("simplecache::gs://b/c").is_shared


def test_ls_verify_export_from_a_config_file_and_a_python_module(tmp_path, tiers3):
    for step in range(5):
        save(tiers3, step)
    settle(tiers3)
    toml = write_toml(tmp_path)
    doc = json.loads(cli("ls", "--config", toml, "--json").stdout)
    assert doc["namespace"] == "run" and len(doc["tiers"]) == 3
    committed = {(r["step"], r["tier_index"]) for r in doc["steps"] if r["state"] == "committed"}
    assert {(4, 0), (4, 1), (4, 2), (3, 0), (2, 1), (0, 2)} <= committed
    # the very object a training script builds, from its module
    (tmp_path / "train_cfg.py").write_text(
        "from tiered_dcp import Tier, TieredConfig\n"
        f"ROOT = {str(tmp_path)!r}\n"
        "def make():\n"
        "    return TieredConfig('run', [Tier(ROOT + '/ram/{node}', every=1, keep=2),\n"
        "        Tier(ROOT + '/ssd/{node}', every=2, keep=3),\n"
        "        Tier(ROOT + '/bucket', every=4, compression='zstd', shared=True)])\n"
        "CONFIG = make()\n"
    )
    for source in ("python:train_cfg:CONFIG", "python:train_cfg:make"):
        out = cli("ls", "--config", source, cwd=tmp_path).stdout
        assert out.splitlines()[1].split()[0] == "4" and out.splitlines()[1].count("committed") == 3
    r = cli("ls", "--config", "python:train_cfg:ROOT", cwd=tmp_path, check=False)
    assert r.returncode == 2 and "is a str, not a TieredConfig" in r.stderr
    r = cli("ls", "--config", toml, "-n", "run", str(tmp_path / "x"), check=False)
    assert r.returncode != 0 and "not both" in r.stderr
    doc = json.loads(cli("verify", "--config", toml, "--json").stdout)
    assert doc["step"] == 4 and doc["ok"] and [t["ok"] for t in doc["tiers"]] == [True] * 3
    (part,) = glob.glob(str(tmp_path / "ssd/0/run/step_000000000004/rank_*.part"))
    flip_byte(part, 0.7)
    r = cli("verify", "--config", toml, "--json", check=False)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and not doc["ok"]
    bad = [t for t in doc["tiers"] if not t["ok"]]
    assert [t["tier_index"] for t in bad] == [1] and any(part in p for p in bad[0]["problems"])
    r = cli("export", "--config", toml, "--step", "2", "--to", str(tmp_path / "exp"))
    assert "exported step 2 to" in r.stdout
