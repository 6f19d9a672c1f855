"""Run inside a subprocess whose PYTHONPATH holds the trainers installed by test_trainer_adapters.py
(so ray, pandas, datasets … never enter the pytest process). Prints one JSON object.

    python trainer_checks.py verl|openrlhf|shuffle_r1|all EXPORT_DIR RESPONSES_JSONL WORK_DIR
        → {"verl": {…}, "openrlhf": {…}, "shuffle_r1": {…}}

RESPONSES_JSONL: one ``{"prompt_id", "rollout_idx", "response"}`` per line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tiny_qwen2vl_processor(work: Path, texts: list[str]):
    """A Qwen2-VL processor (the real class) over a tiny BPE tokenizer; nothing downloaded."""
    from transformers import AutoProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from packing.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(texts, work / "tok", 600)
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
                            tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=tok.chat_template)
    proc.save_pretrained(str(work / "processor"))
    return AutoProcessor.from_pretrained(str(work / "processor")), tok


_PROC: list = []


def _processor(work: Path, responses: list[dict]):
    if not _PROC:
        _PROC.extend(tiny_qwen2vl_processor(work, [r["response"] for r in responses]))
    return _PROC


def verl_check(export: Path, responses: list[dict], work: Path) -> dict:
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.reward_manager.batch import BatchRewardManager
    from verl.workers.reward_manager.naive import NaiveRewardManager

    files = sorted(str(f) for f in (export / "verl").glob("*.parquet"))
    proc, tok = _processor(work, responses)
    data_cfg = OmegaConf.create({"prompt_key": "prompt", "image_key": "images", "max_prompt_length": 4096,
                                 "filter_overlong_prompts": False, "truncation": "error", "return_raw_chat": True,
                                 "cache_dir": str(work / "verl_cache")})
    ds = RLHFDataset(data_files=files, tokenizer=tok, config=data_cfg, processor=proc)
    rows = [ds[i] for i in range(len(ds))]
    image_parts = [sum(1 for m in r["raw_prompt"] for c in (m["content"] if isinstance(m["content"], list) else [])
                       if c.get("type") == "image") for r in rows]
    by_pid = {}
    for r in responses:
        by_pid.setdefault(r["prompt_id"], []).append(r)

    # one verl batch: each dataset row repeated once per rollout, as GRPO's rollout.n does
    items, keys = [], []
    for r in rows:
        for roll in sorted(by_pid[r["extra_info"]["prompt_id"]], key=lambda x: x["rollout_idx"]):
            items.append((r, roll["response"]))
            keys.append((roll["prompt_id"], roll["rollout_idx"]))
    resp_ids = [tok(t, add_special_tokens=False)["input_ids"] for _, t in items]
    roundtrip = all(tok.decode(ids, skip_special_tokens=True) == t for ids, (_, t) in zip(resp_ids, items))
    P, R = 4, max(len(x) for x in resp_ids)
    prompts = torch.full((len(items), P), tok.pad_token_id, dtype=torch.long)
    responses_t = torch.full((len(items), R), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(items), P + R), dtype=torch.long)
    attn[:, :P] = 1
    for i, ids in enumerate(resp_ids):
        responses_t[i, :len(ids)] = torch.tensor(ids)
        attn[i, P:P + len(ids)] = 1
    batch = collate_fn([{k: v for k, v in r.items() if k in ("data_source", "reward_model", "extra_info")}
                        for r, _ in items])
    non_tensor = {k: np.array(list(v), dtype=object) for k, v in batch.items()}
    data = DataProto.from_dict(tensors={"prompts": prompts, "responses": responses_t, "attention_mask": attn},
                               non_tensors=non_tensor)

    fn_cfg = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(REPO / "rl_select/trainers/verl_reward.py"), "name": "compute_score"}}})
    naive = NaiveRewardManager(tokenizer=tok, num_examine=0, compute_score=get_custom_reward_fn(fn_cfg))
    out = naive(data, return_dict=True)
    lengths = attn[:, P:].sum(-1)
    naive_scores = [float(out["reward_tensor"][i, lengths[i] - 1]) for i in range(len(items))]
    batch_cfg = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(REPO / "rl_select/trainers/verl_reward.py"), "name": "compute_score_batch"}}})
    bm = BatchRewardManager(tokenizer=tok, num_examine=0, compute_score=get_custom_reward_fn(batch_cfg))
    bout = bm(data, return_dict=True)
    batch_scores = [float(bout["reward_tensor"][i, lengths[i] - 1]) for i in range(len(items))]

    # what verl 0.9.1's trainer runs: the reward loop's manager, built by load_reward_manager from the
    # config, awaiting run_single per sample (compute_score goes to a thread-pool executor)
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.ray_utils import get_event_loop

    loop_cfg = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(REPO / "rl_select/trainers/verl_reward.py"), "name": "compute_score"},
        "reward_manager": {"source": "register", "name": "naive"}}})
    rl_manager = load_reward_manager(loop_cfg, tok)

    async def run_all():
        import asyncio

        return await asyncio.gather(*[rl_manager.run_single(data[i:i + 1]) for i in range(len(items))])

    loop_scores = [float(r["reward_score"]) for r in get_event_loop().run_until_complete(run_all())]
    return {"rows": len(rows), "image_parts": image_parts, "row_keys": sorted(rows[0]),
            "answer_types": sorted({r["extra_info"]["answer_type"] for r in rows}), "roundtrip": roundtrip,
            "keys": keys, "naive": naive_scores, "batch": batch_scores, "reward_loop": loop_scores,
            "extra_keys": sorted(out["reward_extra_info"])}


def openrlhf_check(export: Path, responses: list[dict], work: Path) -> dict:
    """OpenRLHF's PromptDataset preprocessing (chat template, ``<image>`` → image parts) and its
    SingleTurnAgentExecutor loading our file and calling ``reward_func`` the way it does."""
    import asyncio

    from openrlhf.datasets.prompts_dataset import preprocess_data
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    proc, tok = _processor(work, responses)
    executor = SingleTurnAgentExecutor(str(REPO / "rl_select/trainers/openrlhf_reward.py"))
    rows = [json.loads(line) for f in sorted((export / "openrlhf").glob("*.jsonl"))
            for line in f.read_text().splitlines()]
    by_pid = {}
    for r in responses:
        by_pid.setdefault(r["prompt_id"], []).append(r)
    queries, prompts, labels, keys, image_parts = [], [], [], [], []
    for row in rows:
        prompt, label = preprocess_data(row, None, "prompt", "reward_label", tok.apply_chat_template)
        image_parts.append(prompt.count("<|image_pad|>"))
        for roll in sorted(by_pid[row["id"]], key=lambda x: x["rollout_idx"]):
            # what the executor decodes: prompt tokens + generated tokens up to and including <|im_end|>
            queries.append(prompt + roll["response"] + "<|im_end|>")
            prompts.append(prompt)
            labels.append(label)
            keys.append((roll["prompt_id"], roll["rollout_idx"]))
    infos = asyncio.run(executor._fetch_rewards_via_func(queries, prompts, labels))
    return {"rows": len(rows), "image_parts": image_parts, "images": [len(r["images"]) for r in rows],
            "keys": keys, "scores": [float(i["scores"][0]) for i in infos],
            "extra_logs": sorted(infos[0]["extra_logs"]) if infos else []}


def shuffle_r1_check(export: Path, responses: list[dict], work: Path) -> dict:
    """Shuffle-R1 on a verl batch (``grpo/shuffle_r1_verl.py``, loaded by file path with verl's own loader, as the
    HANDOFF says): G groups × N rollouts with token-level rewards on each response's last token, reordered as
    ``balance_batch`` reorders them, verl's GRPO advantage, then the reshape. Returns what the test compares with
    the pure selection: each row's id and advantage in and out, and the alignment of every key, checked here."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.import_utils import load_extern_object

    G, N, P, R = 8, 8, 3, 6
    gen = torch.Generator().manual_seed(0)
    B = G * N
    lengths = torch.randint(1, R + 1, (B,), generator=gen)
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    # success rates per group: two flat groups (all 0, all 1), the rest mixed
    p = torch.tensor([0.0, 1.0] + [0.2, 0.35, 0.5, 0.5, 0.65, 0.8])
    score = (torch.rand(B, generator=gen) < p.repeat_interleave(N)).float()
    token_rewards = torch.zeros(B, R)
    token_rewards[torch.arange(B), lengths - 1] = score
    uid = np.array([f"prompt-{g}" for g in range(G) for _ in range(N)], dtype=object)
    row_id = np.array([f"row-{i}" for i in range(B)], dtype=object)
    data = DataProto.from_dict(
        tensors={"responses": torch.randint(0, 100, (B, R), generator=gen), "response_mask": response_mask,
                 "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1),
                 "token_level_rewards": token_rewards, "row": torch.arange(B)},
        non_tensors={"uid": uid, "row_id": row_id, "data_source": np.array(["demo"] * B, dtype=object)},
        meta_info={"temperature": 1.0, "global_token_num": (P + lengths).tolist()})
    data.reorder(torch.randperm(B, generator=gen))        # what balance_batch does before the advantages
    data.meta_info["global_token_num"] = data.batch["attention_mask"].sum(-1).tolist()
    adv, ret = compute_grpo_outcome_advantage(data.batch["token_level_rewards"], data.batch["response_mask"],
                                              index=data.non_tensor_batch["uid"])
    data.batch["advantages"], data.batch["returns"] = adv, ret

    reshape = load_extern_object(str(REPO / "grpo" / "shuffle_r1_verl.py"), "reshape_dataproto")
    out, metrics = reshape(data, alpha=0.5, S=4, seed=7, step=3, dp_size=2)
    flat, _ = reshape(data, alpha=0.5, S=4, seed=7, step=3, dp_size=1)

    src = {data.non_tensor_batch["row_id"][i]: i for i in range(len(data))}
    aligned = []
    for j in range(len(out)):
        i = src[out.non_tensor_batch["row_id"][j]]
        aligned.append(all(torch.equal(out.batch[k][j], data.batch[k][i]) for k in data.batch.keys())
                       and all(out.non_tensor_batch[k][j] == data.non_tensor_batch[k][i]
                               for k in data.non_tensor_batch)
                       and out.meta_info["global_token_num"][j] == data.meta_info["global_token_num"][i])
    errors = {}
    gae = data.select_idxs(np.arange(len(data)))
    gae.batch["advantages"] = gae.batch["advantages"] + 0.5 * torch.arange(R)[None] * gae.batch["response_mask"]
    uneven = data.select_idxs(np.arange(1, len(data)))
    for name, bad in (("token_varying", gae), ("uneven_groups", uneven)):
        try:
            reshape(bad, alpha=0.5, S=4)
            errors[name] = ""
        except ValueError as e:
            errors[name] = str(e)
    row_adv = (adv * data.batch["response_mask"]).sum(-1) / data.batch["response_mask"].sum(-1)
    # the TRL path (ovpipe grpo's Hook 1, rank 0) on the same advantages in group order, seed 7 at step 3
    from types import SimpleNamespace

    from grpo.shuffle_r1 import make_reshaper

    perm, _ = load_extern_object(str(REPO / "grpo" / "shuffle_r1_verl.py"), "group_order")(data.non_tensor_batch["uid"])
    group = torch.as_tensor([int(u.split("-")[1]) for u in data.non_tensor_batch["uid"][perm]])
    trainer = SimpleNamespace(num_generations=N, args=SimpleNamespace(steps_per_generation=1),
                              state=SimpleNamespace(global_step=3), accelerator=None)
    trl = make_reshaper(alpha=0.5, S=4, seed=7)({"advantages": row_adv[perm], "prompt_ids": group[:, None],
                                                 "completion_mask": data.batch["response_mask"][perm],
                                                 "row": torch.as_tensor(perm)}, trainer)
    return {"type": type(out).__name__, "rows_in": len(data), "rows_out": len(out), "flat_rows": len(flat),
            "uid_in": list(data.non_tensor_batch["uid"]), "row_id_in": list(data.non_tensor_batch["row_id"]),
            "adv_in": row_adv.tolist(), "row_id_out": list(out.non_tensor_batch["row_id"]),
            "row_id_flat": list(flat.non_tensor_batch["row_id"]), "aligned": aligned,
            "row_id_trl": [data.non_tensor_batch["row_id"][i] for i in trl["row"].tolist()],
            "batch_keys": sorted(out.batch.keys()), "non_tensor_keys": sorted(out.non_tensor_batch),
            "meta_kept": out.meta_info["temperature"] == 1.0 and set(out.meta_info) == set(data.meta_info),
            "metrics": metrics, "errors": errors}


if __name__ == "__main__":
    which, export, resp_file, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    sys.path.insert(0, str(REPO))
    resp = [json.loads(line) for line in resp_file.read_text().splitlines()]
    checks = {"verl": verl_check, "openrlhf": openrlhf_check, "shuffle_r1": shuffle_r1_check}
    print(json.dumps({name: fn(export, resp, work) for name, fn in checks.items() if which in (name, "all")}))
