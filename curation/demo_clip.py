"""``demo-clip``: a tiny open_clip model trained on the demo corpus, so the demo's concept
retrieval means something (MetaCLIP cannot be downloaded here).

The model is ``ovpipe-tiny-clip`` (``curation/model_configs``: ViT 3×128 on 64-px images, text
transformer 3×128), trained from scratch with open_clip's own ``ClipLoss`` on the demo's
(image, caption) pairs for ``steps`` AdamW steps (≈1–2 minutes on 2 CPU cores). It is saved as a
plain state-dict checkpoint that ``embed-images`` / ``embed-concepts`` then load with
``create_model_and_transforms("ovpipe-tiny-clip", pretrained=<path>)`` — the code path a real
MetaCLIP checkpoint takes. The report gives recall@K of the ground-truth concepts the demo
generator drew (``ground_truth.parquet``), before and after training:

    recall@K = mean_i |topK(i) ∩ GT(i)| / |GT(i)|
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np

from manifests.io import atomic_write
from ovpipe.config import check_local_path, check_range, check_step_folder
from ovpipe.step import Step, TaskContext


@dataclass
class DemoClipConfig:
    ground_truth: str = ""            # demo-data/ground_truth.parquet
    vocabulary: str = ""              # demo-data/concepts.txt
    model: str = "ovpipe-tiny-clip"  # the open_clip architecture trained (curation/model_configs)
    steps: int = 300  # optimizer steps
    batch_size: int = 128  # image-caption pairs per step
    lr: float = 2e-3  # AdamW learning rate
    k: int = 5  # concepts per image in the ground-truth check
    seed: int = 0  # the initialisation and batch order
    threads: int = 2  # torch threads
    samples_step: str = "ingest"  # the ingest step folder trained on

    def __post_init__(self):
        if not self.ground_truth or not self.vocabulary:
            raise ValueError("ground_truth and vocabulary: paths written by `ovpipe demo-data`")
        if self.steps < 0 or self.batch_size < 2:
            raise ValueError("steps must be >= 0 and batch_size >= 2")
        check_range(self, "lr", 0, lo_open=True)
        check_range(self, "k", 1)
        check_range(self, "seed", 0)
        check_range(self, "threads", 1)
        check_step_folder("samples_step", self.samples_step)

    def check(self, run_dir) -> None:
        check_local_path("ground_truth", self.ground_truth)
        check_local_path("vocabulary", self.vocabulary)


def recall_at_k(pred: np.ndarray, truth: list[list[int]]) -> float:
    hits = [len(set(p.tolist()) & set(t)) / len(t) for p, t in zip(pred, truth) if t]
    return float(np.mean(hits)) if hits else 0.0


def _images(rows, preprocess):
    import torch
    from PIL import Image

    from curation.ingest import read_image_bytes
    from manifests.conversation import upright_rgb

    xs = []
    for r in rows:
        with Image.open(io.BytesIO(read_image_bytes(r))) as im:
            xs.append(preprocess(upright_rgb(im)))
    return torch.stack(xs)


def evaluate(net, tokenizer, images, truth, vocab: list[str], k: int) -> float:
    import torch

    from curation.assign import topk_torch
    from curation.concepts import DEFAULT_TEMPLATES, embed_texts

    net.eval()
    with torch.inference_mode():
        e = torch.nn.functional.normalize(net.encode_image(images).float(), dim=-1).numpy()
    c = embed_texts(vocab, DEFAULT_TEMPLATES, net, tokenizer, "cpu", 512)
    _, ids = topk_torch(e, c, k)
    return recall_at_k(ids, truth)


def run(cfg: DemoClipConfig, task: TaskContext) -> None:
    import open_clip
    import pyarrow.parquet as pq
    import torch
    from open_clip.loss import ClipLoss

    from curation.clip import register_configs
    from curation.concepts import read_vocabulary

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    register_configs()
    net, _, preprocess = open_clip.create_model_and_transforms(cfg.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(cfg.model)
    samples = [r for r in task.read_input("samples", step=cfg.samples_step).to_pylist() if r["status"] == "ok"]
    gt = {r["sample_id"]: r["concept_ids"] for r in pq.read_table(cfg.ground_truth).to_pylist()}
    samples = [r for r in samples if r["sample_id"] in gt]
    _, vocab = read_vocabulary(cfg.vocabulary)
    with task.stats.timer("decode"):
        images = _images(samples, preprocess)
    # Text per step: the caption, or — half the time — one concept the caption mentions, found by
    # substring match against the vocabulary (MetaCLIP's own way of linking captions to concepts).
    # This teaches single concepts rather than whole-caption memorisation.
    caps = [r["caption"] for r in samples]
    mentions = [[c for c in vocab if f" {c}" in f" {cap}"] for cap in caps]
    cap_tokens = tokenizer(caps)
    concept_tokens = tokenizer([f"a photo of a {c}." for c in vocab])
    cid = {c: i for i, c in enumerate(vocab)}
    mention_ids = [[cid[c] for c in m] for m in mentions]
    truth = [gt[r["sample_id"]] for r in samples]
    before = evaluate(net, tokenizer, images, truth, vocab, cfg.k)

    loss_fn = ClipLoss()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(cfg.steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(cfg.seed)
    net.train()
    losses = []
    with task.stats.timer("train"), task.progress(cfg.steps, unit="step", desc="demo-clip train") as bar:
        t_start = time.perf_counter()
        for step in range(cfg.steps):
            idx = torch.randperm(len(samples), generator=g)[: cfg.batch_size]
            coin = torch.rand(len(idx), generator=g)
            pick = torch.rand(len(idx), generator=g)
            rows = []
            for j, i in enumerate(idx.tolist()):
                m = mention_ids[i]
                rows.append(concept_tokens[m[int(pick[j] * len(m))]] if m and coin[j] < 0.5 else cap_tokens[i])
            img_f = net.encode_image(images[idx], normalize=True)
            txt_f = net.encode_text(torch.stack(rows), normalize=True)
            loss = loss_fn(img_f, txt_f, net.logit_scale.exp())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                net.logit_scale.clamp_(0, np.log(100))
            losses.append(float(loss.detach()))
            bar.update(1, loss=losses[-1],
                       samples_per_s=(step + 1) * cfg.batch_size / (time.perf_counter() - t_start))
    after = evaluate(net, tokenizer, images, truth, vocab, cfg.k)
    ckpt = task.data_path("tiny-clip.pt")
    with atomic_write(ckpt) as tmp:
        torch.save({"state_dict": net.state_dict()}, tmp)
    task.stats.info.update({"recall_before": before, "recall_after": after, "loss_first": losses[0] if losses else None,
                            "loss_last": float(np.mean(losses[-10:])) if losses else None, "checkpoint": str(ckpt)})
    (task.step_dir / "report.md").write_text(
        f"Tiny open_clip model `{cfg.model}` trained {cfg.steps} steps (batch {cfg.batch_size}) with ClipLoss on "
        f"{len(samples)} demo pairs; checkpoint `{ckpt}`.\n\n"
        f"| recall@{cfg.k} of the drawn concepts ({len(vocab)}-concept vocabulary) | value |\n| --- | ---: |\n"
        f"| random weights (before) | {before:.3f} |\n| after training | {after:.3f} |\n"
        f"| chance level ≈ K/V | {cfg.k / len(vocab):.3f} |\n\n"
        f"Contrastive loss {losses[0] if losses else float('nan'):.3f} → {np.mean(losses[-10:]) if losses else float('nan'):.3f}.\n")


STEP = Step("demo-clip", DemoClipConfig, run, inputs={"samples": "samples_step"}, max_tasks=1, check=DemoClipConfig.check,
            description="train the demo's tiny open_clip model (ClipLoss) and score concept recall")
