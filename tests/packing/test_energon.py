"""The packs through Megatron-Energon's own code: `pack` leaves a `.nv-meta/` written by `energon prepare`,
and energon's `get_train_dataset` + `get_loader` / `get_savable_loader` at 2 ranks × 2 workers, with our
cooker (`packing.energon.PackedTaskEncoder`), yield every pack exactly once per epoch, each equal to the
`packs` manifest and to the tar's own members."""
import collections
import io
import json
import tarfile

import numpy as np
import pytest
import yaml
from test_conversation_pack import write_conversation_samples

from manifests import read_manifest
from ovpipe.cli import main

SEQ = 128          # small, so the demo-like conversations fill several packs (and some are truncated)


@pytest.fixture(scope="module")
def pack_run(tmp_path_factory):
    from packing.tiny_tokenizer import build_tiny_tokenizer

    run = tmp_path_factory.mktemp("energon")
    rows = write_conversation_samples(run)
    build_tiny_tokenizer([t["text"].replace("<image>", "") for r in rows for t in r["conversation"]],
                         run / "tokenizer")
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "samples_steps=[ingest-conv]",
                 "--set", f"seq_len={SEQ}", "--set", "on_too_long=truncate", "--run-dir", str(run),
                 "--tasks", "2", "--quiet"]) == 0
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", "--run-dir", str(run),
                 "--tasks", "2", "--quiet"]) == 0
    return run


def test_pack_folder_is_a_prepared_energon_dataset(pack_run):
    from megatron.energon.flavors.webdataset.metadata import get_dataset_info

    meta = pack_run / "pack" / ".nv-meta"
    assert yaml.safe_load((meta / "dataset.yaml").read_text()) == {"__module__": "megatron.energon",
                                                                    "__class__": "CrudeWebdataset"}
    packs = read_manifest(pack_run, "packs").to_pylist()
    shards = sorted({p["shard"] for p in packs})
    assert len(shards) >= 3
    split = yaml.safe_load((meta / "split.yaml").read_text())["split_parts"]
    assert list(split) == ["train"]
    import braceexpand

    assert [x for pat in split["train"] for x in braceexpand.braceexpand(pat)] == [f"data/{s}" for s in shards]
    counts = collections.Counter(p["shard"] for p in packs)
    assert get_dataset_info(pack_run / "pack")["shard_counts"] == {f"data/{s}": n for s, n in sorted(counts.items())}
    assert (meta / "index.sqlite").stat().st_size > 0 and (meta / "index.uuid").read_text()


def _tar_members(run):
    out = {}
    for tar in sorted((run / "pack" / "data").glob("pack-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                out.setdefault(int(key), {})[ext] = tf.extractfile(m).read()
    return out


@pytest.mark.parametrize("savable", [False, True], ids=["get_loader", "get_savable_loader"])
def test_two_ranks_two_workers_read_every_pack_once(pack_run, savable):
    from megatron.energon import WorkerConfig, get_loader, get_savable_loader, get_train_dataset

    from packing.energon import PackedSample, PackedTaskEncoder

    packs = {p["pack_id"]: p for p in read_manifest(pack_run, "packs").to_pylist()}
    lengths = {r["sample_id"]: r for r in read_manifest(pack_run, "lengths").to_pylist()}
    members = _tar_members(pack_run)
    pad = json.loads((pack_run / "tokenizer" / "tokenizer.json").read_text())
    pad = next(t["id"] for t in pad["added_tokens"] if t["content"] == "<|image_pad|>")
    assert set(members) == set(packs)
    seen = collections.Counter()
    per_rank = []
    for rank in range(2):
        wc = WorkerConfig(rank=rank, world_size=2, num_workers=2)
        ds = get_train_dataset(pack_run / "pack", worker_config=wc, batch_size=1, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, repeat=False, task_encoder=PackedTaskEncoder())
        loader = (get_savable_loader if savable else get_loader)(ds)
        got = []
        for batch in loader:
            assert isinstance(batch, list) and len(batch) == 1
            got.extend(batch)
        per_rank.append({s.pack_id for s in got})
        for s in got:
            assert isinstance(s, PackedSample)
            seen[s.pack_id] += 1
            p, m = packs[s.pack_id], members[s.pack_id]
            assert s.__key__ == f"{s.pack_id:012d}"
            # the manifest: sub-samples, their token counts and offsets, the pack's total
            assert s.sample_ids == p["sample_ids"]
            assert np.diff(s.cu_seqlens).tolist() == p["lengths"] == [lengths[x]["total_tokens"] for x in s.sample_ids]
            assert s.cu_seqlens[:-1].tolist() == p["offsets"]
            assert len(s.input_ids) == len(s.loss_mask) == len(s.position_ids) == p["total_tokens"] <= s.seq_len == SEQ
            assert int(s.loss_mask.sum()) == sum(lengths[x]["target_tokens"] for x in s.sample_ids)
            assert (s.position_ids[s.cu_seqlens[:-1]] == 0).all()
            # the tar: ids and mask byte for byte, every image member in order, with its grid
            assert np.load(io.BytesIO(m["ids.npy"])).tobytes() == s.input_ids.tobytes()
            assert np.load(io.BytesIO(m["mask.npy"])).tobytes() == s.loss_mask.tobytes()
            imgs = sorted(k for k in m if k.startswith("img"))
            assert s.images == [m[k] for k in imgs]
            assert sum(s.images_per_sample) == len(s.images) == len(s.image_grids) == len(imgs)
            assert [g for g in s.image_grids.tolist()] == json.loads(m["json"])["image_grids"]
            # each sub-sample's images: Σ grid/4 image pads in its span; its lengths row adds vision start/end
            first = np.concatenate([[0], np.cumsum(s.images_per_sample)])
            for k, x in enumerate(s.sample_ids):
                g = s.image_grids[first[k]:first[k + 1]]
                span = s.input_ids[s.cu_seqlens[k]:s.cu_seqlens[k + 1]]
                pads = int((span == pad).sum())
                assert int((g[:, 0] * g[:, 1]).sum()) // 4 == pads == lengths[x]["image_tokens"] - 2 * len(g)
    assert seen == collections.Counter({pid: 1 for pid in packs}), "every pack exactly once per epoch"
    assert all(per_rank) and not (per_rank[0] & per_rank[1])
