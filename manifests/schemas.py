"""One Arrow schema per manifest kind.

``sample_id`` is the xxh3-64 of the images' bytes in order followed by the conversation's
canonical encoding, written as 16 lowercase hex characters, so every output joins back to its
source row. For a caption pair (one image, ``[user: "<image>", assistant: caption]``) the
encoding is the caption's bytes as the source stores them, so a caption pair keeps the id it
had before conversations existed; the full rule is in ``manifests/conversation.py``.
``SORT_KEYS`` gives the canonical order of a merged manifest: that order, not the rank
that wrote a row, is what makes merged outputs identical for any task count.
"""
from __future__ import annotations

import pyarrow as pa

from manifests.conversation import IMAGE_ADDRESS, TURN


class ManifestSchemaError(ValueError):
    """A Parquet part does not match the schema of its manifest kind."""


STATUS = pa.string()  # "ok" or a short reason: "corrupt_image", "empty_caption", "too_long", …

SCHEMAS: dict[str, pa.Schema] = {
    # ingest — one row per source sample (a conversation with 0..n images); images stay in the
    # source files. shard/key/offset/size/image_format/width/height describe the *first* image
    # (what the curation steps embed; -1/0/"" for a text-only sample), `images` every image in
    # placeholder order; `caption` is the caption of a caption pair, else the first assistant turn.
    "samples": pa.schema([
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("lang", pa.string()),              # the language (config `lang`, `{lang}` of `source_from`, `lang_column`)
        ("shard", pa.string()),
        ("key", pa.string()),
        ("shard_format", pa.string()),      # "tar" | "parquet" | "json": the kind of file the sample came from
        ("offset", pa.int64()),             # tar: byte offset of the image member data; parquet: row index
        ("size", pa.int64()),               # tar: image byte size; parquet: image byte size
        ("image_format", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("caption", pa.string()),
        ("category", pa.string()),          # "caption" for caption pairs; else the row's / config's category
        ("n_images", pa.int32()),
        ("images", pa.list_(IMAGE_ADDRESS)),
        ("conversation", pa.list_(TURN)),   # (role, text) with <image> placeholders, roles system|user|assistant
        ("turns", pa.int32()),
        ("turn_ratings", pa.map_(pa.string(), pa.list_(pa.int32()))),  # per-turn quality ratings (FineVision)
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # ingest — one row per input file (tar, Parquet, JSON): whether it could be read whole. A file
    # that is not its format (not a tar, not Parquet) has no samples rows, only this one; a cut tar
    # keeps the samples before the cut. Join with samples on `shard`.
    "shards": pa.schema([
        ("shard", pa.string()),             # the input file, as samples.shard
        ("source", pa.string()),
        ("format", pa.string()),            # the adapter (webdataset, caption-parquet, ...); "" if undetected
        ("shard_format", pa.string()),      # "tar" | "parquet" | "json"
        ("samples", pa.int64()),            # samples rows read from it (all tasks)
        ("status", STATUS),                 # ok | bad_shard | truncated_shard | missing_column
        ("error", pa.string()),
    ]),
    # mix — a seeded draw over several ingested sources to target proportions; consumed by
    # lengths/pack like `balanced` (copies = how many times the sample enters packing).
    "mixed": pa.schema([
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("category", pa.string()),
        ("copies", pa.int32()),
    ]),
    # embed-images — vectors live in fp16 .npy shards, L2-normalised, row-aligned with this.
    "image_embeddings": pa.schema([
        ("sample_id", pa.string()),
        ("file", pa.string()),              # .npy shard, relative to the run folder
        ("row", pa.int32()),                # -1 when status is not ok
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # dedup — one row per image_embeddings row: semantic near-duplicates by cosine inside k-means clusters.
    # status: ok (kept) | near_duplicate (cosine to the kept `duplicate_of` > 1 − ε) | the embed status of a
    # row that has no vector (decode_error, ...). Rows are never deleted; balance skips near_duplicate ones.
    "dedup": pa.schema([
        ("sample_id", pa.string()),
        ("cluster", pa.int32()),            # top-level k-means cluster; -1 without a vector
        ("duplicate_of", pa.string()),      # the kept sample it duplicates; NULL unless near_duplicate
        ("similarity", pa.float32()),       # cosine to duplicate_of; NULL unless near_duplicate
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # index — one row per image_embeddings row: its place in the faiss index and on the viewer's 2-D map.
    "embedding_map": pa.schema([
        ("sample_id", pa.string()),
        ("position", pa.int64()),           # row of the index (data/ids.npy); -1 without a vector
        ("x", pa.float32()),                # 2-D layout (k-means centroids by PCA + own offset); NULL without
        ("y", pa.float32()),                # a vector
        ("cluster", pa.int32()),            # k-means cluster (the IVF list); -1 without a vector
        ("in_map", pa.bool_()),             # drawn for the map page (≈ map_rows rows, a seeded draw)
        ("status", STATUS),                 # the embed status
    ]),
    # align — image–text cosine of each sample's image and caption (a conversation: its first user +
    # assistant turn) through the same CLIP. status: ok | low_alignment (score < threshold) | no_text |
    # the embed status of a row that has no vector.
    "alignment": pa.schema([
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("text_kind", pa.string()),         # "caption" | "first_turn" | NULL when not scored
        ("score", pa.float32()),            # cosine(image, text); NULL when not scored
        ("threshold", pa.float32()),        # the source's cut that was applied; NULL when not scored
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # embed-concepts
    "concepts": pa.schema([
        ("concept_id", pa.int32()),
        ("text", pa.string()),
        ("file", pa.string()),
        ("row", pa.int32()),
    ]),
    # assign — exact top-K inner product, scores descending.
    "assignments": pa.schema([
        ("sample_id", pa.string()),
        ("concept_ids", pa.list_(pa.int32())),
        ("scores", pa.list_(pa.float32())),
    ]),
    # balance — global concept frequencies before and after resampling.
    "concept_counts": pa.schema([
        ("concept_id", pa.int32()),
        ("text", pa.string()),
        ("count_before", pa.int64()),
        ("count_after", pa.int64()),
    ]),
    # balance — resampled corpus: copies is how many times a sample enters packing.
    "balanced": pa.schema([
        ("sample_id", pa.string()),
        ("weight", pa.float64()),
        ("copies", pa.int32()),
    ]),
    # recaption — one row per (sample_id, lang): a VLM's caption of the sample's image with its
    # quality-check status (ok | empty | refused | wrong_language | repetition | truncated |
    # too_short | error). lengths/pack train on the ok ones (caption_source); the sample they make
    # names this sample_id as its lengths.source_sample_id.
    "captions": pa.schema([
        ("sample_id", pa.string()),         # the source sample
        ("lang", pa.string()),              # "en" | "zh" | ... (a key of the config's prompts)
        ("caption", pa.string()),
        ("model", pa.string()),
        ("backend", pa.string()),
        ("prompt_id", pa.string()),         # "<lang>:<xxh3 of the prompt text, 8 hex>"
        ("tokens", pa.int32()),             # generated tokens (end-of-sequence included)
        ("finish_reason", pa.string()),     # stop | length | error
        ("script_ratio", pa.float64()),     # share of letters in the language's script; null if no letters
        ("repeat_ratio", pa.float64()),     # 1 − distinct/total n-grams; null if shorter than n
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # lengths — tokens a sample occupies in training (shared length function).
    "lengths": pa.schema([
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("text_tokens", pa.int32()),
        ("image_tokens", pa.int32()),
        ("total_tokens", pa.int32()),
        ("target_tokens", pa.int32()),      # tokens the loss is taken on (assistant turns + their end token)
        ("turns_kept", pa.int32()),         # turns after `truncate` dropped whole trailing pairs
        ("images", pa.int32()),             # images of the kept turns
        ("vit_sq", pa.int64()),             # Σ over them of (tower tokens: patches + 1)², for packing.cost
        ("status", STATUS),
        ("error", pa.string()),
        ("source_sample_id", pa.string()),  # the ingested sample it derives from (itself, unless recaptioned)
    ]),
    # pack — one row per packed sequence.
    "packs": pa.schema([
        ("pack_id", pa.int64()),
        ("sample_ids", pa.list_(pa.string())),
        ("lengths", pa.list_(pa.int32())),
        ("offsets", pa.list_(pa.int32())),
        ("total_tokens", pa.int32()),
        ("shard", pa.string()),
        # what the pack costs to train (packing.cost): its counts, and their FLOP-weighted sum
        ("attn_sq", pa.int64()),            # Σ sample length²
        ("images", pa.int32()),
        ("vit_tokens", pa.int64()),         # tower tokens: patches + one class token per image
        ("vit_sq", pa.int64()),             # Σ per image (tower tokens)²
        ("cost", pa.float64()),             # forward + backward FLOPs (or seconds, with fitted weights)
    ]),
    # pack-official — one row per sub-sample of a pack step's packs, in the official layout (packing.official).
    "official_packs": pa.schema([
        ("pack_id", pa.int64()),
        ("slot", pa.int32()),               # position of the sample in the pack
        ("sample_id", pa.string()),
        ("ovpipe_tokens", pa.int32()),      # the packs manifest's length (ovpipe's encoding)
        ("official_tokens", pa.int32()),    # under the official task encoder; NULL when not written
        ("shard", pa.string()),             # the official tar holding it; NULL when not written
        ("status", STATUS),                 # ok | text_only | multi_image | multi_turn
        ("error", pa.string()),
    ]),
    # import-packs — one row per entry of an official-layout folder.
    "imported_packs": pa.schema([
        ("pack_id", pa.int64()),            # the entry's position in the folder (tars in path order)
        ("source_shard", pa.string()),      # the official tar, relative to its folder
        ("key", pa.string()),               # the entry's key there
        ("n_samples", pa.int32()),
        ("total_tokens", pa.int32()),       # under ovpipe's encoding; NULL when not imported
        ("status", STATUS),                 # ok | bad_json | bad_text | empty | misaligned | missing_image | bad_image
                                            # | image_mismatch | too_long | unreadable
        ("error", pa.string()),
    ]),
    # rl-ingest / rl-gym
    "rl_prompts": pa.schema([
        ("prompt_id", pa.string()),         # xxh3-64 hex of source, question, ground truth, image bytes
        ("source", pa.string()),            # data set name (config `source`, else the row's, else file stem)
        ("category", pa.string()),          # free-form task family (verl `ability`); "default" when absent
        ("question", pa.string()),          # user text; exactly one "<image>" per entry of `images`
        ("images", pa.list_(pa.binary())),  # encoded image files (PNG/JPEG bytes), in placeholder order
        ("ground_truth", pa.string()),      # plain string; structured answers (boxes, lists) as JSON text
        ("answer_type", pa.string()),       # key of rl_select.rewards.REWARDS (math, choice, number, bbox, ...)
        ("extra", pa.string()),             # JSON object: adapter-specific fields, reward parameters
        ("status", STATUS),                 # ok | image_mismatch | bad_image | bad_row | duplicate | ...
        ("error", pa.string()),             # human-readable reason when status != ok
    ]),
    # rollout
    "rollouts": pa.schema([
        ("prompt_id", pa.string()),
        ("rollout_idx", pa.int32()),
        ("prompt_type", pa.string()),       # "answer_only" | "thinking"
        ("response", pa.string()),
        ("tokens", pa.int32()),
        ("backend", pa.string()),
        ("model", pa.string()),
        ("sampling", pa.string()),          # JSON of the sampling parameters
    ]),
    # score
    "rewards": pa.schema([
        ("prompt_id", pa.string()),
        ("rollout_idx", pa.int32()),
        ("reward", pa.float64()),
        ("correct", pa.bool_()),
        ("reward_type", pa.string()),
        ("status", STATUS),
        ("error", pa.string()),
    ]),
    # select
    "selection": pa.schema([
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("category", pa.string()),
        ("n", pa.int32()),
        ("correct", pa.int32()),
        ("pass_at_1", pa.float64()),        # NULL (not 0) when n = 0: nothing was scored
        ("pass_at_n", pa.float64()),
        ("gap", pa.float64()),
        ("mean_reward", pa.float64()),
        ("pass_at_k", pa.map_(pa.int32(), pa.float64())),   # {k: pass@k} for the configured k set; NULL when n = 0
        ("kept", pa.bool_()),
        ("reason", pa.string()),            # "kept" | "too_easy" | "too_hard" | "no_gap" | "held_out" | "error"
        ("split", pa.string()),             # "stage1-answer-only" | "stage2-cot" | null
    ]),
    # pretrain: one row per optimizer step of a stage (RUN/pretrain/train_metrics/part-<stage idx>.parquet)
    "train_metrics": pa.schema([
        ("stage", pa.string()),             # "1" | "1.5" | "2"
        ("step", pa.int64()),
        ("loss", pa.float64()),             # token mean over target tokens
        ("lr", pa.float64()),
        ("grad_norm", pa.float64()),
        ("tokens_per_s", pa.float64()),
        ("mfu", pa.float64()),
        ("tokens", pa.int64()),
        ("images", pa.int64()),
        ("packs", pa.int64()),              # packs consumed by this step (all DP ranks)
        ("samples", pa.int64()),            # source samples inside those packs
        # NULL below where the stage's metrics.jsonl record predates them
        ("hfu", pa.float64()),              # hardware FLOPs utilisation: MFU plus the recomputed forward
        ("step_s", pa.float64()),           # wall time of the step, the wait for data included
        ("data_wait_s", pa.float64()),      # waiting for the loader + host→device copies
        ("fwd_bwd_s", pa.float64()),        # forward + backward (GPU: CUDA events; CPU: host time)
        ("optimizer_s", pa.float64()),      # the optimizer step
    ]),
    # grpo: one row per optimizer step of an RL stage (RUN/grpo/grpo_metrics/); NULL where a figure is undefined
    # for the step (a hook that did not run, a batch with no finished completion)
    "grpo_metrics": pa.schema([
        ("stage", pa.string()),             # "answer_only" | "cot"
        ("step", pa.int64()),
        ("reward_mean", pa.float64()),      # the summed, scaled reward over the step's generated rollouts
        ("reward_std", pa.float64()),
        ("zero_std_group_share", pa.float64()),        # groups whose rollouts all scored the same: no signal
        ("small_advantage_share", pa.float64()),       # trained rollouts with |A| < 0.1 (advantage collapsing)
        ("nonzero_grad_rollout_share", pa.float64()),  # trained rollouts with A != 0
        ("token_utilization", pa.float64()),           # generated tokens that carry a non-zero gradient
        ("completion_len_mean", pa.float64()),
        ("completion_len_min", pa.float64()),
        ("completion_len_max", pa.float64()),
        ("clip_ratio_low", pa.float64()),
        ("clip_ratio_high", pa.float64()),
        ("clip_ratio_region", pa.float64()),
        ("truncated_share", pa.float64()),  # completions that hit max_completion_length
        ("loss", pa.float64()),
        ("lr", pa.float64()),
        ("grad_norm", pa.float64()),
        ("generated_tokens", pa.float64()),
        ("generate_s", pa.float64()),
        ("generate_tokens_per_s", pa.float64()),
        ("step_time_s", pa.float64()),
        ("reward_timeout", pa.float64()),   # rewards of the step that timed out / raised (scored 0)
        ("reward_error", pa.float64()),
        ("extras", pa.string()),            # JSON: TRL's other logged figures, the reshape_* / rollout_* columns
    ]),
    # eval: one row per lmms-eval task × metric × filter over an exported model (RUN/eval/eval/)
    "eval": pa.schema([
        ("task", pa.string()),
        ("metric", pa.string()),            # "exact_match"; NULL on a no_result row
        ("filter", pa.string()),            # lmms-eval's filter name ("none")
        ("value", pa.float64()),            # NULL when lmms-eval reports none ("N/A", NaN): status "undefined"
        ("stderr", pa.float64()),           # NULL when undefined
        ("n_samples", pa.int64()),          # docs scored ("effective", after --limit)
        ("model", pa.string()),             # the exported folder
        ("lmms_eval_version", pa.string()),
        ("status", STATUS),                 # "ok" | "undefined" | "no_result"
    ]),
}

SORT_KEYS: dict[str, tuple[str, ...]] = {
    "samples": ("sample_id", "source", "shard", "key"),
    "shards": ("shard",),
    "image_embeddings": ("sample_id",),
    "dedup": ("sample_id",),
    "alignment": ("sample_id",),
    "embedding_map": ("sample_id",),
    "concepts": ("concept_id",),
    "assignments": ("sample_id",),
    "concept_counts": ("concept_id",),
    "balanced": ("sample_id",),
    "mixed": ("sample_id",),
    "captions": ("sample_id", "lang"),
    "lengths": ("sample_id",),
    "packs": ("pack_id",),
    "official_packs": ("pack_id", "slot"),
    "imported_packs": ("pack_id",),
    "rl_prompts": ("prompt_id",),
    "rollouts": ("prompt_id", "rollout_idx", "prompt_type"),
    "rewards": ("prompt_id", "rollout_idx", "reward_type"),
    "selection": ("prompt_id",),
    "train_metrics": ("stage", "step"),
    "grpo_metrics": ("stage", "step"),
    "eval": ("task", "metric", "filter"),
}


def schema_for(kind: str) -> pa.Schema:
    try:
        return SCHEMAS[kind]
    except KeyError:
        raise KeyError(f"unknown manifest kind {kind!r}; known kinds: {sorted(SCHEMAS)}") from None
