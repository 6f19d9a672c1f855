"""import-packs on malformed official folders: every malformed entry is a row with its status (null prompts or
captions, no image, a tar cut short), and an index that is not energon's (no ``shard_counts``, a tar name
outside the folder) or a ``~/`` source is decided before any work, naming ``source``."""
import json

import pytest

from manifests import read_manifest
from ovpipe.cli import main
from tests.fuzz.builders import jpeg, official_entry, official_folder, tiny_tokenizer

P = "<image>Describe the image."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _import(tok, source, run, *extra):
    return main(["import-packs", "--set", f"source={source}", "--set", f"tokenizer={tok}", "--set", "seq_len=512",
                 "--run-dir", str(run), "--quiet", *extra])


def test_every_malformed_entry_is_a_status_row(tok, tmp_path):
    img = jpeg()
    good = official_entry("a", {"prompts": [P], "captions": ["a cat."], "images": ["x"]}, [img])
    tars = {"data/pack-0.tar": [
        *good,
        *official_entry("b", {"prompts": [None], "captions": ["a cat."], "images": ["x"]}, [img]),
        *official_entry("c", {"prompts": [P], "captions": [None], "images": ["x"]}, [img]),
        *official_entry("d", {"prompts": [P], "captions": [7], "images": ["x"]}, [img]),
        *official_entry("e", {"prompts": [], "captions": [], "images": []}, []),
        *official_entry("f", {"prompts": None, "captions": ["a dog."], "images": ["x"]}, [img]),   # captioning
        *official_entry("g", {"captions": "a cat.", "images": ["x"]}, [img]),
        *official_entry("h", [1, 2], [img]),
        *official_entry("i", None, [img]),
    ], "data/pack-1.tar": [*official_entry("j", {"prompts": [P], "captions": ["a cat."], "images": ["x"]}, [img]),
                           *official_entry("k", {"prompts": [P], "captions": ["a dog."], "images": ["x"]}, [img])]}
    j_bytes = sum(512 + -(-len(data) // 512) * 512 for _, data in tars["data/pack-1.tar"][:2])   # header + blocks
    folder = official_folder(tmp_path / "src", tars, cut={"data/pack-1.tar": j_bytes + 600})    # inside k's json
    assert _import(tok, folder, tmp_path / "run") == 0
    rows = read_manifest(tmp_path / "run", "imported_packs", step="import-packs").to_pylist()
    assert [(r["pack_id"], r["key"], r["status"]) for r in rows] == [
        (0, "a", "ok"), (1, "b", "bad_text"), (2, "c", "bad_text"), (3, "d", "bad_text"), (4, "e", "empty"),
        (5, "f", "ok"), (6, "g", "bad_json"), (7, "h", "bad_json"), (8, "i", "bad_json"),
        (9, "j", "ok"), (10, None, "unreadable")]
    assert all(r["error"] for r in rows if r["status"] != "ok")
    assert "captions[0] is null" in rows[2]["error"] and "pack-1.tar" in rows[10]["error"]
    packs = read_manifest(tmp_path / "run", "packs", step="import-packs").to_pylist()
    assert [p["pack_id"] for p in packs] == [0, 5, 9] and all(p["total_tokens"] > 0 for p in packs)


@pytest.mark.parametrize("info, says", [
    ({"shard_counts": {"/etc/passwd": 1}}, "not a path inside"),
    ({"shard_counts": {"../outside.tar": 1}}, "not a path inside"),
    ({"shard_counts": {"data/pack-0.tar": "1"}}, "not a count"),
    ({"shards": ["data/pack-0.tar"]}, "no shard_counts"),
    ([1, 2], "no shard_counts"),
    ({"shard_counts": {"data/missing.tar": 1}}, "missing"),
])
def test_an_index_that_is_not_energons_is_refused_before_any_work(tok, tmp_path, capsys, info, says):
    (tmp_path / "outside.tar").write_bytes(b"")
    folder = official_folder(tmp_path / "src", {"data/pack-0.tar": official_entry(
        "a", {"prompts": [P], "captions": ["a cat."], "images": ["x"]}, [jpeg()])}, info=json.dumps(info).encode())
    assert _import(tok, folder, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "source" in err and says in err, err
    assert not (tmp_path / "run" / "import-packs").exists()


def test_a_home_relative_source_is_read(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    official_folder(tmp_path / "packs", {"data/pack-0.tar": official_entry(
        "a", {"prompts": [P], "captions": ["a cat."], "images": ["x"]}, [jpeg()])})
    assert _import(tok, "~/packs", tmp_path / "run") == 0
    rows = read_manifest(tmp_path / "run", "imported_packs", step="import-packs").to_pylist()
    assert [(r["key"], r["status"]) for r in rows] == [("a", "ok")]
