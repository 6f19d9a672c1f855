"""Run in a subprocess with lmms-eval's cache folder first on ``sys.path`` (its own transformers 4.57):
load an exported folder through lmms-eval's ``llava_onevision1_5`` class, run its ``generate_until`` on the
requests of ``REQUESTS.json`` (``[{"image": path, "question": str}]``), and write ``OUT.npz``: the answers,
and per request the inputs lmms-eval's own code built (``input_ids``, ``pixel_values``, ``image_grid_thw``)
with the model's logits for the first generated token, recorded by wrapping the model's ``generate``.

    python lmms_eval_checks.py FOLDER REQUESTS.json OUT.npz
"""
import json
import sys

import numpy as np
import torch
import transformers
from lmms_eval.api.instance import Instance
from lmms_eval.models.simple.llava_onevision1_5 import Llava_OneVision1_5
from PIL import Image


def main(folder: str, requests_path: str, out: str) -> None:
    reqs = json.loads(open(requests_path).read())
    pre = json.loads(open(f"{folder}/preprocessor_config.json").read())
    lm = Llava_OneVision1_5(pretrained=folder, device="cpu", device_map="cpu", batch_size=1,
                            min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"])
    docs = {i: {"image": Image.open(r["image"]).convert("RGB"), "question": r["question"]} for i, r in enumerate(reqs)}
    lm.task_dict = {"handmade": {"test": docs}}
    seen = []
    model, generate = lm.model, lm.model.generate

    def recording_generate(**kw):
        with torch.inference_mode():
            logits = model(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"],
                           pixel_values=kw["pixel_values"], image_grid_thw=kw["image_grid_thw"]).logits[:, -1]
        seen.append({"input_ids": kw["input_ids"][0].numpy(), "pixel_values": kw["pixel_values"].float().numpy(),
                     "image_grid_thw": kw["image_grid_thw"].numpy(), "logits": logits[0].float().numpy()})
        return generate(**kw)

    model.generate = recording_generate
    instances = [Instance(request_type="generate_until", idx=0, metadata={"task": "handmade", "doc_id": i, "repeats": 1},
                          arguments=(d["question"], {"max_new_tokens": 4, "until": ["<|im_end|>"]},
                                     lambda doc: [doc["image"]], i, "handmade", "test"))
                 for i, d in docs.items()]
    answers = lm.generate_until(instances)
    # generate_until reorders requests (longest first); the questions (all different) say which is which
    order = [next(i for i, d in docs.items() if d["question"] in lm.tokenizer.decode(s["input_ids"])) for s in seen]
    arrays = {"answers": np.array(json.dumps(answers)), "transformers": np.array(transformers.__version__)}
    for i, s in zip(order, seen):
        arrays.update({f"{k}_{i}": v for k, v in s.items()})
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4])
