"""The embedded demo: the synthetic corpus (`corpus`, `conversations`), the RL prompt set
(`rl`), and the tiny random models the demo and the tests generate with (`tiny_vlm`). Nothing here
is imported by a stage; it sits on top of them."""


def write_demo_data(out, n_samples: int = 2000, seed: int = 0, shards: int = 4, conversations: bool = True,
                    planted: int = 24) -> dict:
    """``ovpipe demo-data``: the caption shards (``corpus``) and, unless told not to, the LLaVA-558K-style
    and instruction sets (``conversations``), and the image-QA task folder lmms-eval runs on (``eval_tasks``)
    under ``out``; the caption shards gain ``planted`` near-duplicates of each kind and mismatched captions
    (``corpus.plant_cases``); returns what was written."""
    from pathlib import Path

    from demo.conversations import write_demo_conversations
    from demo.corpus import write_demo_corpus
    from demo.eval_tasks import write_demo_eval_tasks

    info = write_demo_corpus(Path(out), n_samples=n_samples, seed=seed, shards=shards, planted=planted)
    if conversations:
        info["conversations"] = write_demo_conversations(Path(out), seed=seed)
    info["eval_tasks"] = write_demo_eval_tasks(Path(out), seed=seed)
    return info
