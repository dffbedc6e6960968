"""ptx.data: tokenizers, chat templates, record kinds, grain pipelines and packing.

`make_pipeline` (grain-backed) loads on first use,
so `from ptx.data import ByteTokenizer` does not import grain. The seqio
adapter (`ptx.data.seqio_adapter`, the `ptx[seqio]` extra) is never imported
from here.
"""

from typing import Any

from ptx.data.batch import pack_rows, pad_batch, sft_example
from ptx.data.chat import CHATML, ChatMLTemplate, ChatTemplate, JinjaChatTemplate, encode_chat
from ptx.data.global_batch import to_global
from ptx.data.hf_tokenizer import HFTokenizer, load_tokenizer
from ptx.data.records import RecordError
from ptx.data.sentencepiece_tokenizer import SentencePieceTokenizer
from ptx.data.sources import ArrayRecordSource, JsonlSource, MemorySource, write_array_record
from ptx.data.tokenizer import ByteTokenizer, Tokenizer

_PIPELINE = ("make_pipeline",)

__all__ = [
    "ArrayRecordSource", "ByteTokenizer", "CHATML", "ChatMLTemplate", "ChatTemplate", "HFTokenizer",
    "JinjaChatTemplate", "JsonlSource", "MemorySource", "RecordError", "SentencePieceTokenizer",
    "Tokenizer", "encode_chat", "load_tokenizer", "pack_rows", "pad_batch", "sft_example", "to_global",
    "write_array_record", *_PIPELINE,
]


def __getattr__(name: str) -> Any:
  if name in _PIPELINE:
    from ptx.data import pipeline

    return getattr(pipeline, name)
  raise AttributeError(f"module 'ptx.data' has no attribute {name!r}")
