"""A poisoned request's KV never reaches a later request, on `transformers serve
--continuous-batching` under `guardrails run`: every clean request sent after one gets, greedy,
the very text it got on the same server before any poisoned request was sent.

`transformers.end_poisoned_requests` turns NaN and Inf into 0 in `PagedAttentionCache.update`
before the paged cache stores them, ends the poisoned request and frees its blocks out of the
prefix cache (`no_cache=True`). Blocks of 4 tokens (one block per sector for this model) keep
every prompt here within two blocks, so the requests after the poisoned one are prefilled and
decoded in the very blocks it wrote.

transformers reads a request's KV only at the positions that request wrote
(`FullAttentionCacheAllocator.get_read_indices`), so a freed block's stale values are
overwritten before anything reads them: these tests also pass with the KV healing off (its NaN
then stays in the freed block until the next request writes over it). What they hold to is
the freeing, the prefix cache and the retry; the healing's own proof is the shared batch
(test_serve_batching.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from guardrails.integrations.transformers_hooks import MESSAGE
from tests.e2e.client import CLEAN, GREEDY, Outcome, chat
from tests.e2e.server import Server
from tests.e2e.transformers.serve import serving

PAGE = 4  # tokens per block: the chat template adds one token ("sota") to each prompt
CONTAINED_ARGS = ("--cb-block-size", str(PAGE), "--cb-num-blocks", "32")
CONTAINED_ARGS += ("--cb-max-batch-tokens", "64")
# A clean first block (kalo mipe rita nuso), then the trigger in the second one.
POISONED = "kalo mipe rita nuso quasar veta"
SHARED = "kalo mipe rita nuso bogi dabo"  # the poisoned prompt's first block, then clean words
SHORT = "fegi dabo kami"  # one block: never a prefix-cache match (one token is always left)
LONG = 24  # decoding walks over the poisoned request's other blocks too


@pytest.fixture(scope="module")
def contained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("contained") / "server.log"
    with serving(model_dir, log, "--continuous-batching", *CONTAINED_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def references(contained: Server) -> dict[str, str]:
    """Each clean prompt's greedy text on this server before any poisoned request."""
    assert contained.poisoned_sent == 0
    found = {text: chat(contained, text, GREEDY, LONG) for text in (SHORT, SHARED, CLEAN[0])}
    assert all((o.error, o.finish_reason) == (None, "length") for o in found.values())
    assert all(o.text for o in found.values())
    return {text: o.text for text, o in found.items()}


def _assert_ended(outcome: Outcome) -> None:
    assert getattr(outcome.error, "status_code", None) == 500
    assert outcome.error is not None
    assert outcome.error.body == {"detail": MESSAGE}


def _assert_reference(server: Server, text: str, references: dict[str, str]) -> None:
    outcome = chat(server, text, GREEDY, LONG)
    assert (outcome.error, outcome.finish_reason) == (None, "length")
    assert outcome.text == references[text]


def test_a_request_in_the_poisoned_requests_freed_blocks_gets_its_text(
    contained: Server, references: dict[str, str]
) -> None:
    """The next blocks handed out are the ones the poisoned request just freed: with one block
    per sector, `Scheduler._try_to_meet_safety_margin` gives its blocks back as free sectors
    (`CachePool.try_to_free_sectors` appends them to `free_sectors`) and
    `CachePool.allocate_sector` pops the last one: its last block (the trigger's) goes first.
    Each block the clean request completes duplicates one its reference run left in the prefix
    cache, so `mark_complete_blocks` swaps it for that one and frees the fresh block, which is
    handed out again: every block this request writes is the trigger's."""
    _assert_ended(chat(contained, POISONED, GREEDY))
    _assert_reference(contained, SHORT, references)
    assert contained.health() == (200, {"status": "ok"})


def test_a_prompt_sharing_the_poisoned_prompts_clean_prefix_gets_its_text(
    contained: Server, references: dict[str, str]
) -> None:
    """transformers 5.24's continuous batching has a prefix cache (`allow_block_sharing`, on by
    default, no `transformers serve` flag turns it off): a request's complete blocks are
    hashed after the forward that fills them (`PagedAttentionCache.mark_complete_blocks`, from
    `update_batch`), a freed hashed block is kept cached, and a new prompt's leading whole
    blocks are matched (`Scheduler._infer_request_tokens`, `search_prefix_match`). The poisoned
    prompt shares its first block with SHARED, whose reference run cached it: the first
    poisoned request reads it from the cache, and freeing it with `no_cache=True` drops that
    block's hash. A poisoned request is never hashed itself (it leaves the batch update before
    `mark_complete_blocks`). SHARED is then prefilled whole, in the poisoned request's two
    blocks, and a second SHARED reads its first block from the prefix cache that run rebuilt."""
    _assert_ended(chat(contained, POISONED, GREEDY))
    _assert_reference(contained, SHARED, references)
    _assert_reference(contained, SHARED, references)


def test_the_poisoned_prompt_retried_still_fails_and_the_server_goes_on(
    contained: Server, references: dict[str, str]
) -> None:
    """The fault is in the weights: a retry must not be served healed KV from a cache."""
    for _ in range(2):
        _assert_ended(chat(contained, POISONED, GREEDY))
        assert contained.health() == (200, {"status": "ok"})
    _assert_reference(contained, CLEAN[0], references)
    _assert_reference(contained, SHORT, references)
