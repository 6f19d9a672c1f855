"""The exported folder through lmms-eval's own ``llava_onevision1_5`` model class: its ``generate_until`` on
hand-made image + question requests answers strings, its first-token logits equal our load of the same
folder (``llava_ov.official.from_pretrained`` under the venv's transformers) within fp32 tolerance, and the
chat template turns each request into the token ids that packing counts for that conversation.

lmms-eval 0.7.3 and what its class imports, with its own transformers 4.57.6 (why: requirements/lmms-eval.in,
docs/eval.md), are pip-installed ``--no-deps`` from ``requirements/lmms-eval.txt`` into a cache folder outside
the venv (``pretrain.evaluate.ensure_lmms_eval``) and run in a subprocess (``lmms_eval_checks.py``). No registry, no lmms-eval: the tests skip and say so.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_official_parity import exported, official  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent
SYSTEM = "You are a helpful assistant."        # lmms-eval's llava_onevision1_5 default system prompt
REQUESTS = [((56, 84), (200, 30, 30), "What colour is the shape?"),     # (h, w), colour, question
            ((112, 56), (30, 30, 200), "How many shapes are there?"),
            ((84, 84), (30, 160, 30), "Is the square green or blue? Answer in one word.")]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lmms_eval_site() -> Path:
    from pretrain.evaluate import LmmsEvalUnavailable, ensure_lmms_eval

    try:
        return ensure_lmms_eval()
    except LmmsEvalUnavailable as e:
        pytest.skip(str(e))


def _requests(tmp: Path) -> Path:
    from PIL import Image

    reqs = []
    for k, ((h, w), colour, q) in enumerate(REQUESTS):
        Image.new("RGB", (w, h), colour).save(tmp / f"req{k}.png")
        reqs.append({"image": str(tmp / f"req{k}.png"), "question": q})
    (tmp / "requests.json").write_text(json.dumps(reqs))
    return tmp / "requests.json"


def _run_lmms_eval(site: Path, folder: Path, tmp: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(HERE)]), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp / "lmms_eval.npz"
    proc = subprocess.run([sys.executable, str(HERE / "lmms_eval_checks.py"), str(folder), str(_requests(tmp)), str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    return proc, (np.load(out) if proc.returncode == 0 else None)


def test_lmms_eval_generates_and_matches_our_load_and_packing(exported, official, lmms_eval_site, tmp_path):
    from packing.image_tokens import ImageTokenConfig
    from packing.tokens import encode_conversation, load_tokenizer
    from llava_ov.official import from_pretrained

    _, hf, _ = exported
    proc, res = _run_lmms_eval(lmms_eval_site, hf, tmp_path)      # the folder as export-model wrote it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(res["transformers"]).startswith("4.57.")
    answers = json.loads(str(res["answers"]))
    assert len(answers) == len(REQUESTS) and all(isinstance(a, str) for a in answers)

    ours = from_pretrained(hf, dtype=torch.float32).eval()
    tok = load_tokenizer(str(hf))
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    img_cfg = ImageTokenConfig(patch_size=pre["patch_size"], merge_size=pre["merge_size"],
                               min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"])
    for k, ((h, w), _, q) in enumerate(REQUESTS):
        ids = torch.from_numpy(res[f"input_ids_{k}"]).long()[None]
        # the chat template's ids = what packing counts for the same conversation, up to the answer
        turns = [("system", SYSTEM), ("user", "<image>" + q), ("assistant", "Red.")]
        p_ids, p_mask, _, _ = encode_conversation(tok, turns, [(h, w)], img_cfg)
        start = int(np.argmax(p_mask))      # the first loss token: the assistant's text begins
        assert res[f"input_ids_{k}"].tolist() == p_ids[:start].tolist(), q
        # first-token logits: lmms-eval's load (transformers 4.57) vs ours (the venv's), same inputs
        with torch.no_grad():
            logits = ours(input_ids=ids, attention_mask=torch.ones_like(ids),
                          pixel_values=torch.from_numpy(res[f"pixel_values_{k}"]),
                          image_grid_thw=torch.from_numpy(res[f"image_grid_thw_{k}"]).long()).logits[0, -1]
        torch.testing.assert_close(torch.from_numpy(res[f"logits_{k}"]), logits.float(), rtol=1e-4, atol=1e-4)
