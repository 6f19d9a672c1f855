"""Bad input becomes rows (or a `shards` status), never a failed ingest task.

Every bad input is built here: a decompression-bomb PNG, tars cut mid-member / mid-header /
at a member boundary, a `.tar` that is not a tar, Parquet with wrong column types or a missing
column, symlink members, a JPEG with bytes after its EOI, and the same key twice in one tar.
"""
import io
import json
import struct
import tarfile
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from curation.image_header import DEFAULT_MAX_PIXELS, inspect_image, jpeg_complete
from manifests import read_manifest
from manifests.catalog import connect
from ovpipe.cli import main


def img(w=40, h=30, color="red", fmt="JPEG", **save) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (w, h), color).save(b, format=fmt, **save)
    return b.getvalue()


def bomb_png(w=30000, h=30000) -> bytes:
    """A valid 1-bit grey PNG of w×h zero pixels (30000² → ~109 KB), written without PIL."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (w + 7) // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row * 1000) for _ in range(h // 1000)) + z.compress(row * (h % 1000)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def write_tar(path, members) -> list[int]:
    """members: (name, bytes) or (name, ("symlink", target)); returns each member's data offset."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, data[1]
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tf:
        return [m.offset_data for m in tf]


def pairs(n, start=0):
    return [m for k in range(start, start + n)
            for m in ((f"k{k}.jpg", img(40 + k, 30, "red")), (f"k{k}.txt", f"caption {k}".encode()))]


def ingest(run, inputs, *sets, tasks=1, name="ingest", rc=0):
    args = ["ingest", "--name", name, "--set", f"inputs={json.dumps([str(p) for p in inputs])}",
            "--run-dir", str(run), "--tasks", str(tasks), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == rc
    samples = read_manifest(run, "samples", step=name).to_pylist()
    shards = {r["shard"].rsplit("/", 1)[-1]: r for r in read_manifest(run, "shards", step=name).to_pylist()}
    return samples, shards


def by_key(rows, shard=None):
    return {r["key"]: r for r in rows if shard is None or r["shard"].endswith("/" + shard)}


def stats(run, name="ingest"):
    return json.loads((run / name / "stats.json").read_text())["counters"]


# ------------------------------------------------------------------------------------------------
# pixel limit


def test_decompression_bomb_png_is_too_large_from_the_header(tmp_path):
    bomb = bomb_png()
    assert len(bomb) < 200_000
    assert inspect_image(bomb, "header")[:3] == ("too_large", 30000, 30000)
    assert inspect_image(bomb, "full")[0] == "too_large"          # never decoded
    st, w, h, _, err = inspect_image(img(100, 100), "header", max_pixels=5000)
    assert (st, w, h) == ("too_large", 100, 100) and "max_pixels=5000" in err
    assert inspect_image(img(100, 100), "header", max_pixels=10_000)[0] == "ok"
    assert DEFAULT_MAX_PIXELS == 4 * 28 * 28 * 16384

    shard = tmp_path / "web" / "s.tar"
    write_tar(shard, pairs(1) + [("bomb.png", bomb), ("bomb.txt", b"big")] + pairs(1, 2))
    rows, shards = ingest(tmp_path / "run", [shard])
    st = {k: (r["status"], r["width"], r["height"]) for k, r in by_key(rows).items()}
    assert st == {"k0": ("ok", 40, 30), "bomb": ("too_large", 30000, 30000), "k2": ("ok", 42, 30)}
    assert shards["s.tar"]["status"] == "ok" and shards["s.tar"]["samples"] == 3
    # a lower limit from the config
    rows, _ = ingest(tmp_path / "run", [shard], "max_pixels=1000", name="small", rc=1)   # no ok sample: exit 1
    assert {r["status"] for r in rows} == {"too_large"}
    assert main(["ingest", "--set", f"inputs=['{shard}']", "--set", "max_pixels=0",
                 "--run-dir", str(tmp_path / "r2"), "--quiet"]) == 2


# ------------------------------------------------------------------------------------------------
# tars: cut, not a tar, links, the same key twice


def test_tar_cut_mid_member_keeps_members_before_the_cut(tmp_path):
    members = pairs(4)
    full = tmp_path / "full.tar"
    offsets = write_tar(full, members)
    data = full.read_bytes()
    shard = tmp_path / "web" / "cut.tar"
    shard.parent.mkdir()
    shard.write_bytes(data[: offsets[4] + 100])          # inside k2.jpg's data
    rows, shards = ingest(tmp_path / "run", [shard])
    st = {k: r["status"] for k, r in by_key(rows).items()}
    assert st == {"k0": "ok", "k1": "ok", "k2": "truncated_shard"}
    assert "k2.jpg" in by_key(rows)["k2"]["error"] and "100 of" in by_key(rows)["k2"]["error"]
    s = shards["cut.tar"]
    assert (s["status"], s["samples"], s["format"]) == ("truncated_shard", 3, "webdataset")
    assert "unexpected end of data" in s["error"]
    c = stats(tmp_path / "run")
    assert c["shard_status/truncated_shard"] == 1 and c["status/truncated_shard"] == 1 and c["status/ok"] == 2


@pytest.mark.parametrize("where", ["header", "boundary", "caption"])
def test_tar_cut_elsewhere(tmp_path, where):
    full = tmp_path / "full.tar"
    offsets = write_tar(full, pairs(3))
    data = full.read_bytes()
    cut = {"header": offsets[4] - 512 + 200,           # inside k2.jpg's header
           "boundary": offsets[4] - 512,                # right before k2.jpg's header: no end blocks
           "caption": offsets[3] + 3}[where]            # inside k1.txt: the caption is cut, not shortened silently
    shard = tmp_path / "web" / "cut.tar"
    shard.parent.mkdir()
    shard.write_bytes(data[:cut])
    rows, shards = ingest(tmp_path / "run", [shard])
    st = {k: r["status"] for k, r in by_key(rows).items()}
    if where == "caption":
        assert st == {"k0": "ok", "k1": "truncated_shard"}
    else:
        assert st == {"k0": "ok", "k1": "ok"}
    assert shards["cut.tar"]["status"] == "truncated_shard" and shards["cut.tar"]["error"]


def test_not_a_tar_is_a_shard_status_in_sql_and_stats(tmp_path, capsys):
    good = tmp_path / "web" / "a.tar"
    write_tar(good, pairs(2))
    bad = tmp_path / "web" / "b.tar"
    bad.write_bytes(b"<html>not a tar at all</html>" * 40)
    empty = tmp_path / "web" / "c.tar"
    empty.write_bytes(b"")
    run = tmp_path / "run"
    rows, shards = ingest(run, [good, bad, empty], tasks=2)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    assert shards["a.tar"]["status"] == "ok" and shards["a.tar"]["samples"] == 2
    assert (shards["b.tar"]["status"], shards["b.tar"]["samples"]) == ("bad_shard", 0)
    assert "not a readable tar" in shards["b.tar"]["error"]
    assert shards["c.tar"]["status"] == "bad_shard"
    c = stats(run)
    assert c["shard_status/bad_shard"] == 2 and c["shard_status/ok"] == 1 and c["files"] == 3
    main(["sql", str(run), "SELECT status, count(*) AS n FROM shards GROUP BY 1 ORDER BY 1", "--format", "csv"])
    assert "bad_shard,2" in capsys.readouterr().out
    assert "bad_shard" in (run / "ingest" / "report.md").read_text()


def test_symlink_members_become_missing_image_rows(tmp_path):
    shard = tmp_path / "web" / "s.tar"
    write_tar(shard, pairs(1) + [("k1.jpg", ("symlink", "k0.jpg"))]
              + [("k2.jpg", ("symlink", "../elsewhere/x.jpg")), ("k2.txt", b"a caption")] + pairs(1, 3))
    rows, shards = ingest(tmp_path / "run", [shard])
    r = by_key(rows)
    assert set(r) == {"k0", "k1", "k2", "k3"}
    assert r["k1"]["status"] == "missing_image" and "symlink" in r["k1"]["error"] and "k0.jpg" in r["k1"]["error"]
    assert r["k2"]["status"] == "missing_image" and "x.jpg" in r["k2"]["error"]
    assert r["k2"]["caption"] == "a caption" and r["k3"]["status"] == "ok"
    assert shards["s.tar"]["status"] == "ok"


def test_same_key_twice_in_one_tar_keeps_the_first_copy(tmp_path):
    a, b = img(40, 30, "red"), img(50, 30, "blue")
    shard = tmp_path / "web" / "s.tar"
    write_tar(shard, [("k0.jpg", a), ("k0.txt", b"red"), ("k1.jpg", b), ("k1.txt", b"blue"),
                      ("k0.jpg", a), ("k0.txt", b"red"),                              # later, same key + content
                      ("k2.jpg", b), ("k2.txt", b"two"), ("k2.jpg", b), ("k2.txt", b"two")])  # twice in a row
    run = tmp_path / "run"
    rows, shards = ingest(run, [shard])
    assert len(rows) == 5 and shards["s.tar"]["samples"] == 5
    for key in ("k0", "k2"):
        same = [r for r in rows if r["key"] == key]
        assert sorted(r["status"] for r in same) == ["duplicate", "ok"], key
        dup = next(r for r in same if r["status"] == "duplicate")
        assert f"s.tar/{key}" in dup["error"] and "same key" in dup["error"]
    # stats agree with the manifest, status by status — also after a finalize killed after it
    # rewrote the parts and rerun (counting its changes instead would lose them on the rerun)
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    assert counts == {"ok": 3, "duplicate": 2}
    for again in (False, True):
        if again:
            (run / "ingest" / "completions" / "finalized").unlink()
            rows2, _ = ingest(run, [shard])
            assert rows2 == rows
        c = stats(run)
        assert {k[len("status/"):]: v for k, v in c.items() if k.startswith("status/") and v} == counts
        assert c["duplicates"] == 2


# ------------------------------------------------------------------------------------------------
# Parquet


def test_parquet_wrong_types_and_missing_columns(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    good = img()
    pq.write_table(pa.table({"image": ["a.jpg", "b.jpg"], "caption": ["x", "y"]}), d / "img_str.parquet")
    pq.write_table(pa.table({"image": [good, good], "caption": [1, 2]}), d / "cap_int.parquet")
    pq.write_table(pa.table({"image": pa.array([{"bytes": "abc"}], pa.struct([("bytes", pa.string())])),
                             "caption": ["z"]}), d / "struct_str.parquet")
    pq.write_table(pa.table({"image": [good], "text": ["no caption column"]}), d / "no_cap.parquet")
    (d / "not.parquet").write_bytes(b"PAR1 but not really")
    pq.write_table(pa.table({"image": [good], "caption": ["fine"]}), d / "ok.parquet")
    files = sorted(d.glob("*.parquet"))
    run = tmp_path / "run"
    rows, shards = ingest(run, files, "format=caption-parquet", tasks=2)
    st = {(r["shard"].rsplit("/", 1)[-1], r["key"]): (r["status"], r["error"]) for r in rows}
    assert st[("img_str.parquet", "000000000")][0] == "bad_row" and "image" in st[("img_str.parquet", "000000000")][1]
    assert st[("cap_int.parquet", "000000001")] == ("bad_row", "caption: expected a string, got int")
    assert st[("struct_str.parquet", "000000000")][0] == "bad_row"
    assert st[("ok.parquet", "000000000")][0] == "ok"
    assert len(rows) == 6
    assert shards["no_cap.parquet"]["status"] == "missing_column" and "caption" in shards["no_cap.parquet"]["error"]
    assert shards["not.parquet"]["status"] == "bad_shard"
    assert {shards[f]["status"] for f in ("img_str.parquet", "cap_int.parquet", "ok.parquet")} == {"ok"}
    # auto: a file whose layout cannot be told from its columns is a shard status too
    rows, shards = ingest(run, [d / "no_cap.parquet", d / "ok.parquet"], name="auto")
    assert shards["no_cap.parquet"]["status"] == "missing_column" and "cannot tell" in shards["no_cap.parquet"]["error"]
    assert len(rows) == 1


def test_llava_parquet_struct_with_string_bytes_is_bad_row(tmp_path):
    conv = json.dumps([{"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}])
    t = pa.table({"conversations": [conv, conv],
                  "image": pa.array([{"bytes": img(), "path": None}, {"bytes": None, "path": None}],
                                    pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    p = tmp_path / "ov" / "x.parquet"
    p.parent.mkdir()
    pq.write_table(t, p)
    from curation.formats import BadRow, cell_image
    with pytest.raises(BadRow, match="expected binary"):
        cell_image({"bytes": "abc", "path": None}, str(p), 0, "image", -1, str(tmp_path))
    rows, _ = ingest(tmp_path / "run", [p])
    assert [r["status"] for r in sorted(rows, key=lambda r: r["key"])][0] == "ok"


# ------------------------------------------------------------------------------------------------
# image checks: JPEG end marker, EXIF orientation


def _with_app1_thumbnail(jpeg: bytes, thumb: bytes) -> bytes:
    """``jpeg`` with an APP1 segment holding a whole JPEG (its own EOI) right after SOI."""
    payload = b"Exif\0\0" + thumb
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def test_jpeg_trailing_bytes_after_eoi_are_ok_and_truncation_is_not(tmp_path):
    base = img(64, 48, "green")
    motion = base + b"\0\0\0\x18ftypmp42" + bytes(range(256)) * 40     # a video appended (Motion Photo)
    assert inspect_image(motion, "header")[:3] == ("ok", 64, 48)
    prog = img(64, 48, "blue", progressive=True)
    assert inspect_image(prog + b"trailer" * 50, "header")[0] == "ok"
    png = img(64, 48, "blue", "PNG")
    assert inspect_image(png + b"trailing data " * 20, "header")[0] == "ok"
    for data in (base, prog):
        for cut in (len(data) // 2, len(data) - 2, 300):
            assert inspect_image(data[:cut], "header")[0] == "corrupt_image", cut
    # a thumbnail's EOI inside APP1 does not make a truncated main image look complete
    thumbed = _with_app1_thumbnail(base, img(8, 8, "red"))
    assert jpeg_complete(thumbed) is True and inspect_image(thumbed, "header")[0] == "ok"
    assert jpeg_complete(thumbed[:-40]) is False and inspect_image(thumbed[:-40], "header")[0] == "corrupt_image"
    # ... and a truncated one with garbage that contains FF D9 *inside* a scan is not trusted either
    assert jpeg_complete(base[:-2] + b"\xff\x00\xd9") is False

    shard = tmp_path / "web" / "m.tar"
    write_tar(shard, [("m.jpg", motion), ("m.txt", b"a motion photo")])
    rows, _ = ingest(tmp_path / "run", [shard])
    assert rows[0]["status"] == "ok" and rows[0]["size"] == len(motion)


def test_exif_orientation_swaps_width_and_height(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6                                                   # rotate 90° to display
    rotated = img(40, 30, "red", exif=exif.tobytes())
    exif[0x0112] = 3                                                   # 180°: no swap
    upside = img(40, 30, "red", exif=exif.tobytes())
    assert inspect_image(rotated, "header")[:3] == ("ok", 30, 40)
    assert inspect_image(upside, "header")[:3] == ("ok", 40, 30)
    assert inspect_image(rotated, "full")[:3] == ("ok", 30, 40)
    from PIL import ImageOps
    assert ImageOps.exif_transpose(Image.open(io.BytesIO(rotated))).size == (30, 40)


# ------------------------------------------------------------------------------------------------
# everything at once, any task count


def test_corpus_of_bad_inputs_completes_with_one_row_per_member(tmp_path):
    web = tmp_path / "web"
    write_tar(web / "00-good.tar", pairs(3))
    full = tmp_path / "full.tar"
    offsets = write_tar(full, pairs(3, 10) + [("bomb.png", bomb_png(20000, 20000)), ("bomb.txt", b"big")])
    (web / "01-cut.tar").write_bytes(full.read_bytes()[: offsets[2] + 50])      # inside k1.jpg
    (web / "02-bad.tar").write_bytes(b"\x00garbage" * 100)
    write_tar(web / "03-mixed.tar", pairs(2) + [("bomb.png", bomb_png(20000, 20000)), ("bomb.txt", b"big"),
                                                  ("ln.jpg", ("symlink", "k0.jpg")), ("ln.txt", b"link")])
    inputs = sorted(web.glob("*.tar"))
    one, shards1 = ingest(tmp_path / "r1", inputs, tasks=1)
    three, shards3 = ingest(tmp_path / "r3", inputs, tasks=3)
    assert one == three and shards1 == shards3
    st = {(r["shard"].rsplit("/", 1)[-1], r["key"]): r["status"] for r in one}
    assert len(one) == 3 + 2 + 4
    assert st[("01-cut.tar", "k10")] == "ok" and st[("01-cut.tar", "k11")] == "truncated_shard"
    assert st[("03-mixed.tar", "bomb")] == "too_large" and st[("03-mixed.tar", "ln")] == "missing_image"
    assert st[("03-mixed.tar", "k0")] == "duplicate"                 # same bytes as 00-good.tar/k0
    assert {k: (v["status"], v["samples"]) for k, v in shards1.items()} == {
        "00-good.tar": ("ok", 3), "01-cut.tar": ("truncated_shard", 2), "02-bad.tar": ("bad_shard", 0),
        "03-mixed.tar": ("ok", 4)}
    con = connect(tmp_path / "r1")
    assert con.sql("SELECT sum(samples) FROM shards").fetchall()[0][0] == len(one)
