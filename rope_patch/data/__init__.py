"""Data: documents from the embedded corpus, local files or hub data sets (``documents``), their tokens cached
on disk (``tokens``), training sequences packed from them (``packing``) and PoSE's position ids
(``pose``)."""

from .documents import DEFAULT_CORPUS, Document, documents_fingerprint, load_documents, stdlib_corpus
from .packing import MixedSequences, PackedSequences, sequence_lengths
from .pose import pose_batch, pose_position_ids
from .tokens import TokenizedDocument, resolve_bos, select_documents, tokenize_documents, tokenizer_fingerprint

__all__ = [
    "DEFAULT_CORPUS", "Document", "MixedSequences", "PackedSequences", "TokenizedDocument", "documents_fingerprint", "load_documents",
    "pose_batch", "pose_position_ids", "resolve_bos", "select_documents", "sequence_lengths", "stdlib_corpus", "tokenize_documents", "tokenizer_fingerprint",
]
