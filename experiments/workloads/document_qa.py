"""Long-document QA: many short questions about each of a few long documents.

Each request is one document (``document_len`` tokens, drawn with Zipf
popularity) followed by a question; answers are short.  Prefill of the
document dominates, so a miss costs far more than in chat.  The first
``warmup_per_document x num_documents`` requests are a warm-up, as in
``shared_prefix``.
"""

from __future__ import annotations

from kvserve.experiments.workloads.checks import check_vocab_size
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.shared_prefix import prefix_groups
from kvserve.scheduler.checks import check_ints, check_numbers


def document_qa(
    num_requests: int,
    qps: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    num_documents: int = 32,
    document_len: int = 6144,
    question_len: int = 64,
    output_len: int = 64,
    zipf_exponent: float = 0.8,
    warmup_per_document: int = 4,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Questions about ``num_documents`` long documents."""
    check_ints(1, num_documents=num_documents, output_len=output_len)
    check_ints(0, document_len=document_len, question_len=question_len, warmup_per_document=warmup_per_document)
    check_numbers(0, zipf_exponent=zipf_exponent)
    check_vocab_size(vocab_size)
    if document_len + question_len < 1:
        raise ValueError("document_len + question_len must be >= 1: a prompt cannot be empty")
    return prefix_groups(
        num_requests, qps, seed=seed, burstiness=burstiness, num_groups=num_documents,
        prefix_len=document_len, question_len=question_len, output_len=output_len,
        zipf_exponent=zipf_exponent, num_tenants=0, vocab_size=vocab_size, group_name="doc",
        num_warmup=warmup_per_document * num_documents,
    )
