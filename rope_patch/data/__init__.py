"""Data: documents from the embedded corpus, local files or hub data sets (:mod:`.documents`), their tokens cached
on disk (:mod:`.tokens`), and training sequences packed from them (:mod:`.packing`)."""

from .documents import DEFAULT_CORPUS, Document, documents_fingerprint, load_documents, stdlib_corpus
from .packing import PackedSequences
from .tokens import TokenizedDocument, resolve_bos, select_documents, tokenize_documents, tokenizer_fingerprint

__all__ = [
    "DEFAULT_CORPUS", "Document", "PackedSequences", "TokenizedDocument", "documents_fingerprint", "load_documents",
    "resolve_bos", "select_documents", "stdlib_corpus", "tokenize_documents", "tokenizer_fingerprint",
]
