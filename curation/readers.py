"""Which reader reads a source file of a given format: webdataset tars (``formats``), LLaVA / messages
JSON(L) (``formats_json``), caption / LLaVA-OV / FineVision / messages Parquet (``formats_parquet``). The
readers share the sample model of ``formats``; this dispatch sits above all three, so none of them
imports another."""
from __future__ import annotations

from typing import Callable, Iterator

from curation import formats_json, formats_parquet
from curation.formats import RawSample, read_webdataset


def adapter(fmt: str, path: str) -> Callable[..., Iterator[RawSample]]:
    """``adapter(fmt, path)(path, cfg, take)`` yields the file's samples in the units ``take`` accepts."""
    if fmt == "webdataset":
        return read_webdataset
    if fmt in ("llava-json", "json-auto") or (fmt == "messages" and not path.endswith(".parquet")):
        return formats_json.read_json
    return {"caption-parquet": formats_parquet.read_caption_parquet,
            "llava-ov-parquet": formats_parquet.read_llava_parquet,
            "finevision": formats_parquet.read_finevision,
            "messages": formats_parquet.read_messages_parquet}[fmt]
