"""The official sample types' fields (``docs/packing.md`` lists them), defined from those field lists."""
from __future__ import annotations

from typing import Any, Optional

from megatron.energon import Sample
from megatron.energon.edataclass import edataclass


@edataclass
class PackedCaptioningSample(Sample):
    """One offline pack: one image per sub-sample, with its prompt and caption, in sub-sample order."""

    images: list[Any]
    prompts: Optional[list[str]]
    captions: list[str]


@edataclass
class MultiMixQASample(Sample):
    """One unpacked conversation: ``messages`` ({role, content}), its images, an optional system prompt."""

    messages: list[dict]
    video: Optional[list[Any]] = None
    image: Optional[list[Any]] = None
    system: Optional[str] = None
