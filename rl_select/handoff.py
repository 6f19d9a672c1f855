"""``HANDOFF.md`` beside each export: the trainer command line that trains on the exported data with
ovpipe's rewards (``rl_select/trainers``), one block per split in the recipe's order (stage 1
answer-only, then stage 2 CoT).

Paths are absolute (the export folder and the adapter file of this checkout), so the lines run as
printed; the model path, GPU counts and batch sizes are the user's (``$MODEL``, ``$N_GPUS``). The
reward time limit is the one the run's ``score`` step used (``score_timeout``: found through the
selection's inputs), so training times rewards out exactly where selection did.
"""
from __future__ import annotations

from pathlib import Path

TRAINERS = Path(__file__).resolve().parent / "trainers"

SCALE_NOTE = ("Reward scale and bias are the trainer's: the recipe trains on `(r - 0.5) * 10` (AReaL "
              "`actor.reward_scaling=10.0 actor.reward_bias=-0.5`). GRPO's per-group normalisation "
              "`(r - mean) / std` cancels any affine map, so verl / OpenRLHF (`group_norm`) / ROLL (`grpo`) need "
              "no flag for it; see docs/rl_handoff.md.")


def score_timeout(run_dir: Path, selection_steps: list[str]) -> float:
    """The per-job time limit of the ``score`` step whose rewards the exported selection counted:
    the export's ``selection`` folders → the folders their ``select`` read ``rewards`` from (the
    framework's input resolver, so a score step run under another ``--name`` is found) → that step's
    config. The registry default when the run folder does not say (a selection written by hand)."""
    from ovpipe.inputs import resolve, upstream_config
    from rl_select.trainers import DEFAULT_TIMEOUT_S

    for sel in selection_steps:
        try:
            step, cfg = upstream_config(run_dir, sel)
            for folder in resolve(step, cfg, run_dir, sel).get("rewards", []):
                return float(upstream_config(run_dir, folder)[1].timeout_s)
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    return DEFAULT_TIMEOUT_S


def _verl(root: Path, split: str, timeout: float) -> str:
    f = root / "verl" / f"{split}.parquet"
    return f"""python3 -m verl.trainer.main_ppo \\
  algorithm.adv_estimator=grpo \\
  data.train_files="['{f}']" data.val_files="['{f}']" \\
  data.prompt_key=prompt data.image_key=images data.reward_fn_key=data_source \\
  data.max_prompt_length=2048 data.max_response_length=2048 data.train_batch_size=128 \\
  actor_rollout_ref.model.path=$MODEL actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \\
  reward.custom_reward_function.path={TRAINERS / 'verl_reward.py'} \\
  reward.custom_reward_function.name=compute_score \\
  +reward.custom_reward_function.reward_kwargs.timeout_s={timeout} \\
  trainer.n_gpus_per_node=$N_GPUS trainer.nnodes=1"""


def _verl_shuffle_r1(batch: int = 128, n: int = 16, alpha: float = 0.5, S: int = 8) -> str:
    """How to switch Shuffle-R1 on in verl 0.9.1's ``RayPPOTrainer.fit`` (``grpo/shuffle_r1_verl.py``), with the
    mini-batch arithmetic for the command above widened to the paper's pool (``n`` generated a prompt)."""
    path = TRAINERS.parents[1] / "grpo" / "shuffle_r1_verl.py"
    pairs = batch * int(alpha * (n // 2) + 1e-9)        # grpo.shuffle_r1.pairs_kept_per_group: ⌊α·n/2⌋ a prompt
    T = pairs // S
    mini = 2 * T // n                                   # verl multiplies ppo_mini_batch_size by rollout.n
    return f"""## Shuffle-R1 (optional)

Shuffle-R1 (arXiv 2508.05612; `ovpipe grpo`'s `shuffle_r1`, docs/grpo.md) reshapes verl's batch with
`{path}`: the same pair selection as `ovpipe grpo` (PTS keeps ⌊α·n/2⌋ pairs a prompt, ABS draws S
sub-samplings of T distinct pairs ∝ |A₁| + |A₂|, S × T = the kept pairs), the rows taken with
`DataProto.select_idxs`. verl has no hook for it: in `verl/trainer/ppo/ray_trainer.py`, `RayPPOTrainer.fit`,
add these lines right after `batch = compute_advantage(...)` (the batch then holds `advantages` and the `uid`
groups) and before `# update critic` / `self._update_actor(batch)`:

```python
from verl.utils.import_utils import load_extern_object
reshape = load_extern_object("{path}", "reshape_dataproto")
batch, reshape_metrics = reshape(batch, alpha={alpha}, S={S}, seed=0, step=self.global_steps,
                                 dp_size=self._get_dp_size(self.actor_rollout_wg, "actor"))
metrics.update(reshape_metrics)    # shuffle_r1/rows_in, rows_out, S, T, both symptoms before (_in) and after
```

and run the commands above with

```bash
  algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n={n} \\
  actor_rollout_ref.actor.ppo_mini_batch_size={mini} actor_rollout_ref.actor.shuffle=False
```

What changes: each prompt generates {n} rollouts and the actor trains on {2 * int(alpha * (n // 2) + 1e-9)} of
them — {batch} prompts × {n} = {batch * n} generated, {pairs} pairs kept, drawn as {S} × {T}: {2 * pairs} rows.
verl cuts the actor's batch into mini-batches of `ppo_mini_batch_size × rollout.n` rows, one optimizer step each,
in order (`actor.shuffle=False`, its default; a shuffle would scatter the sub-samplings): at {mini} × {n} = {2 * T}
rows = 2T each of the {S} optimizer steps of a training step is one sub-sampling. `dp_size` lays the rows out so
that this holds across the data-parallel ranks too (verl hands each rank a contiguous slice); it must divide 2T,
and `ppo_micro_batch_size_per_gpu` the {2 * T} / dp_size rows a rank takes per step. The sequence-length balance
that `trainer.balance_batch` made before the advantages is replaced by this layout. Only outcome advantages
(`grpo`) are accepted, in groups of equal size."""


def _openrlhf(root: Path, split: str, timeout: float) -> str:
    return f"""cd {root / 'openrlhf'}   # image paths in the JSONL are relative to this folder
OVPIPE_REWARD_TIMEOUT_S={timeout} python3 -m openrlhf.cli.train_ppo_ray \\
  --actor.model_name_or_path $MODEL --actor.num_gpus_per_node $N_GPUS \\
  --data.prompt_dataset {root / 'openrlhf' / f'{split}.jsonl'} \\
  --data.input_key prompt --data.label_key reward_label --data.image_key images \\
  --data.apply_chat_template --data.max_images_per_prompt 16 \\
  --reward.remote_url {TRAINERS / 'openrlhf_reward.py'} \\
  --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8"""


def _areal(root: Path, split: str, timeout: float) -> str:
    stage = "stage1" if split.startswith("stage1") else "stage2"
    return f"""# $RECIPE = a checkout of LLaVA-OneVision-1.5-RL; in its trains/grpo.py the reward changes (two lines):
#   from rl_select.trainers.areal_reward import reward_parts
#   VisionRLVRWorkflow(reward_fn=reward_parts, ...)        # was reward_fn=reward_system.reward (train and eval)
cd {root / 'areal'}   # image paths in the JSONL are relative to this folder
OVPIPE_REWARD_TIMEOUT_S={timeout} PYTHONPATH={TRAINERS.parents[1]}:$PYTHONPATH \\
python3 -m areal.launcher.local $RECIPE/trains/grpo.py --config $RECIPE/configs/llavaov15-8b_{stage}_grpo.yaml \\
  train_dataset.path={root / 'areal' / split} actor.path=$MODEL \\
  actor.reward_scaling=10.0 actor.reward_bias=-0.5"""


def _roll(root: Path, split: str, tags: list[str], timeout: float) -> str:
    return f"""# in the pipeline YAML (ROLL rlvr_vl pipeline); set OVPIPE_REWARD_TIMEOUT_S={timeout} in the workers' env
actor_train:
  data_args:
    file_name: [{root / 'roll' / f'{split}.parquet'}]
    messages: prompt
    domain_interleave_probs:    # every domain under `rewards` draws its share of a rollout batch
      ovpipe: 1.0
rewards:
  ovpipe:
    worker_cls: rl_select.trainers.roll_reward.OvpipeRewardWorker
    model_args:
      model_name_or_path: ${{pretrain}}
    tag_included: [{', '.join(tags)}]    # the data_source values of this split (ROLL's tag)"""


def write_handoff(fmt: str, root: Path, splits: list[str], tags: dict[str, list[str]], timeout: float) -> Path:
    """``HANDOFF.md`` of one format: a block per split; ``tags``: each split's routing values (ROLL's tags: the data sources)."""
    blocks = []
    for split in splits:
        cmd = {"verl": lambda: _verl(root, split, timeout), "openrlhf": lambda: _openrlhf(root, split, timeout),
               "areal": lambda: _areal(root, split, timeout),
               "roll": lambda: _roll(root, split, tags[split], timeout)}[fmt]()
        lang = "yaml" if fmt == "roll" else "bash"
        blocks.append(f"## {split}\n\n```{lang}\n{cmd}\n```\n")
    text = (f"# {fmt}: train on this export with ovpipe's rewards\n\n"
            f"The reward is `rl_select/trainers/{fmt}_reward.py`: the registry `ovpipe score` used, the same "
            f"per-job time limit ({timeout} s), statuses mapped to a score as `select` counted them.\n"
            f"{SCALE_NOTE}\n\n" + "\n".join(blocks)
            + (f"\n{_verl_shuffle_r1()}\n" if fmt == "verl" else ""))
    path = root / fmt / "HANDOFF.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
