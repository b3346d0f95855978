"""The prefix cache without a model: the tree (match, insert, LRU eviction, refcounts, draft
validity) and the scheduler's use of it (hits leave a token to prefill, eviction before
preemption, ``n`` > 1 sharing, a pool that is whole after random traffic).
"""

from __future__ import annotations

import random

import pytest
from test_scheduler import _NoText, _step

from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.radix_cache import RadixCache
from pcgspec.engine.request import Request
from pcgspec.engine.scheduler import Scheduler
from pcgspec.sampling_params import SamplingParams

P = 4  # page size


def _cache(num_pages: int = 32, track_draft: bool = False) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages)
    return pool, RadixCache(pool, P, track_draft)


def _insert(pool: PagePool, cache: RadixCache, tokens: list[int], draft: int = 0) -> list[int]:
    """A request that wrote ``tokens`` into fresh pages inserts them and finishes."""
    pages = pool.alloc(-(-len(tokens) // P))
    cache.insert(tokens, pages, len(tokens), draft)
    pool.free(pages)
    return pages


def test_match_whole_pages_only_and_within_limit():
    pool, cache = _cache()
    pages = _insert(pool, cache, list(range(10)))  # 2 whole pages + 2 tokens: 2 cached
    assert cache.num_pages == 2 and pool.num_free == 30
    assert cache.match(list(range(10)), 10).pages == pages[:2]
    assert cache.match(list(range(10)), 7).pages == pages[:1]  # the limit cuts a page
    hit = cache.match([0, 1, 2, 3, 4, 5, 9, 9, 9], 9)
    assert hit.pages == pages[:1] and hit.num_tokens == 4  # diverges inside page 2
    assert cache.match([1, 2, 3, 4], 4).num_tokens == 0
    assert all(pool.refcount(p) == 1 for p in pages[:2]) and pool.refcount(pages[2]) == 0


def test_insert_keeps_existing_pages_and_branches():
    pool, cache = _cache()
    first = _insert(pool, cache, list(range(8)))
    second = _insert(pool, cache, list(range(8)) + [50, 51, 52, 53])
    assert cache.num_pages == 3  # the shared 2 pages once, plus the new branch page
    assert pool.refcount(second[0]) == 0  # the duplicate went back with its request
    assert cache.match(list(range(8)) + [50, 51, 52, 53, 0], 12).pages == first + second[2:]
    _insert(pool, cache, [0, 1, 2, 3, 7, 7, 7, 7])
    assert cache.num_pages == 4 and pool.num_free + cache.num_pages == 32


def test_lru_eviction_spares_referenced_pages_and_inner_nodes():
    pool, cache = _cache()
    a = _insert(pool, cache, [1] * 8)
    b = _insert(pool, cache, [2] * 8)
    c = _insert(pool, cache, [3] * 8)
    cache.match([1] * 8, 8)  # a is now the most recently used
    pool.incref(c)  # a request holds c
    assert pool.num_cache_only == 4
    assert cache.evict(1) == 1 and cache.match([2] * 8, 8).num_tokens == 4  # b's leaf went first
    assert cache.evict(10) == 3  # b's root page, then a's two; c is held
    assert cache.num_pages == 2 and cache.match([3] * 8, 8).pages == c
    assert pool.refcount(a[0]) == 0 and pool.refcount(b[0]) == 0
    pool.free(c)
    assert cache.evict(10) == 2 and cache.num_pages == 0 and pool.num_free == 32
    assert cache.stats.evicted_tokens == 6 * P


def _check_tree(cache: RadixCache) -> None:
    """Every node is a run of whole pages, keyed under its parent by its first page."""
    for node in cache._nodes():
        assert node.pages and len(node.tokens) == len(node.pages) * P
        assert node.parent.children[tuple(node.tokens[:P])] is node
        assert 0 <= node.draft_pages <= len(node.pages)
    assert sum(len(n.pages) for n in cache._nodes()) == cache.num_pages


def test_compressed_tree_matches_a_page_by_page_oracle():
    """Random inserts (from the root and past a held hit), matches that split runs, frees and
    evictions: every match returns what a map of each cached page's whole-token prefix gives,
    the tree stays runs of whole pages, and eviction starts where a full scan of the leaves
    would: at the last page of the least recently used leaf that no request holds.
    """
    rng = random.Random(1)
    pool, cache = _cache(num_pages=300)
    oracle: dict[tuple[int, ...], int] = {}  # a cached page's prefix (whole pages) -> page
    held: list[list[int]] = []

    def expected(tokens: list[int], limit: int) -> list[int]:
        pages = []
        while (len(pages) + 1) * P <= limit and tuple(tokens[: (len(pages) + 1) * P]) in oracle:
            pages.append(oracle[tuple(tokens[: (len(pages) + 1) * P])])
        return pages

    stems = [[rng.randrange(4) for _ in range(rng.randrange(2, 9) * P)] for _ in range(4)]
    for _ in range(1500):
        tokens = rng.choice(stems)[: rng.randrange(0, 9) * P] + [
            rng.randrange(4) for _ in range(rng.randrange(1, 4) * P + rng.randrange(P))
        ]
        op = rng.random()
        if op < 0.35 and pool.num_free >= 12:
            hit = cache.match(tokens, len(tokens)) if rng.random() < 0.5 else None
            if hit is not None:
                pool.incref(hit.pages)
            own = pool.alloc(len(tokens) // P - (len(hit.pages) if hit else 0))
            pages = (hit.pages if hit else []) + own
            cache.insert(tokens, pages, len(tokens), after=hit)
            for i in range(len(tokens) // P):
                oracle.setdefault(tuple(tokens[: (i + 1) * P]), pages[i])
            pool.free(pages)
        elif op < 0.75:
            limit = rng.randrange(len(tokens) + 1)
            hit = cache.match(tokens, limit)
            assert hit.pages == expected(tokens, limit)
            if rng.random() < 0.3:
                pool.incref(hit.pages)
                held.append(hit.pages)
        elif op < 0.85 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            leaves = [
                n for n in cache._nodes() if not n.children and pool.refcount(n.pages[-1]) == 1
            ]
            oldest = min((n.last_access for n in leaves), default=None)
            first = {n.pages[-1] for n in leaves if n.last_access == oldest}
            before = set(cache.pages())
            assert cache.evict(rng.randrange(1, 6)) == len(before) - cache.num_pages
            gone = before - set(cache.pages())
            assert bool(gone) == bool(leaves) and (not leaves or gone & first)
            assert all(pool.refcount(page) == 0 for page in gone)
            oracle = {k: v for k, v in oracle.items() if v not in gone}
        _check_tree(cache)
    for pages in held:
        pool.free(pages)
    cache.evict(10**6)
    assert cache.num_pages == 0 and pool.num_free == 300


def test_a_long_prefix_is_one_run_split_where_prompts_part():
    pool, cache = _cache(num_pages=64)
    shared = list(range(40))  # 10 pages
    _insert(pool, cache, shared + [100, 101, 102, 103])
    assert len(cache._nodes()) == 1 and cache.num_pages == 11
    hit = cache.match(shared + [7] * 8, 48)  # parts after 10 pages: the run splits there
    assert hit.num_tokens == 40 and len(cache._nodes()) == 2 and hit.node.children
    _insert(pool, cache, shared + [7] * 8)
    assert sorted(len(n.pages) for n in cache._nodes()) == [1, 2, 10]
    _check_tree(cache)


def test_eviction_cost_does_not_grow_with_the_tree():
    """20,000 one-page evictions from a tree of 20,000 leaves (a full scan per eviction would
    take minutes)."""
    import time

    n = 20_000
    pool, cache = _cache(num_pages=n)
    for i in range(n):
        _insert(pool, cache, [i] * P)
    start = time.perf_counter()
    assert sum(cache.evict(1) for _ in range(n)) == n
    assert time.perf_counter() - start < 10.0
    assert pool.num_free == n and len(cache._heap) <= 1024 + 2 * n


def test_draft_validity_stops_the_match_and_upgrades():
    pool, cache = _cache(track_draft=True)
    tokens = list(range(12))
    old = _insert(pool, cache, tokens, draft=5)  # the draft covered page 0 only
    assert cache.match(tokens, 12).pages == old[:1]
    new = _insert(pool, cache, tokens, draft=12)  # same tokens, draft caught up: pages swap in
    assert cache.match(tokens, 12).pages == [old[0], *new[1:3]]
    assert pool.refcount(old[1]) == 0 and pool.refcount(new[1]) == 1
    assert pool.num_free + cache.num_pages == 32


def test_insert_goes_on_past_the_hit_it_holds():
    """A request on a long cached prefix inserts only the pages past it (no walk over the
    prefix at every step); the tree ends the same as after a walk from the root. A hit whose
    nodes were dropped since (a reset) walks from the root again."""
    pool, cache = _cache()
    _insert(pool, cache, list(range(16)))  # 4 pages, one node
    tokens = [*range(16), 90, 91, 92, 93, 94]
    hit = cache.match(tokens, len(tokens) - 1)
    pool.incref(hit.pages)
    pages = hit.pages + pool.alloc(2)
    touched, touch = [], cache._touch

    def recorded(node, now):
        touched.append(tuple(node.tokens))
        touch(node, now)

    cache._touch = recorded
    cache.insert(tokens, pages, len(tokens), after=hit)
    assert touched == [(90, 91, 92, 93)] and cache.num_pages == 5
    assert cache.match(tokens, len(tokens)).pages == pages[:5]
    cache.reset()
    touched.clear()
    cache.insert(tokens, pages, len(tokens), after=hit)  # its nodes are gone: from the root
    assert touched == [tuple(tokens[:20])] and cache.num_pages == 5
    assert cache.match(tokens, len(tokens)).pages == pages[:5]
    pool.free(pages)
    assert pool.num_free + cache.num_pages == 32


def test_reset_frees_everything():
    pool, cache = _cache()
    _insert(pool, cache, list(range(16)))
    cache.reset()
    assert cache.num_pages == 0 and pool.num_free == 32 and not cache.pages()


# The scheduler ---------------------------------------------------------------------------------


def _req(name: str, tokens: list[int], max_tokens: int = 2, n: int = 1, index: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return Request(
        name, tokens, params, 0, _NoText(), max_len=10_000, group_id=name[0], index=index
    )


def _sched(num_pages: int, budget: int = 64, cache: bool = True) -> Scheduler:
    pool = PagePool(num_pages)
    return Scheduler(pool, P, 8, budget, prefix_cache=RadixCache(pool, P) if cache else None)


def _drain(sched: Scheduler) -> None:
    while _step(sched) is not None:
        pass


def test_hit_leaves_one_token_to_prefill_and_continues_chunked():
    sched = _sched(64, budget=6)
    _drain_one(sched, _req("a", list(range(20))))
    b = _req("b", list(range(20)))  # the same prompt: pages 0..3 cached, 4th would be all of it
    sched.add(b)
    batch = _step(sched)
    assert b.num_cached_tokens == 16 and batch.num_new_tokens == [4]
    c = _req("c", list(range(16)) + list(range(100, 110)))  # a hit, then a chunked prefill
    sched.add(c)  # b decodes beside it: one token of the budget
    assert [_step(sched).num_new_tokens[-1] for _ in range(2)] == [5, 5]
    assert c.num_cached_tokens == 16 and c.num_output_tokens == 1
    _drain(sched)
    stats = sched.prefix_cache.stats
    assert stats.cached_tokens == 32 and stats.prompt_tokens == 20 * 2 + 26


def _drain_one(sched: Scheduler, req: Request) -> None:
    sched.add(req)
    _drain(sched)
    assert req.finished


def test_eviction_comes_before_preemption():
    sched = _sched(8, budget=64)
    for i in range(3):
        _drain_one(sched, _req(f"{i}", [i] * 8))  # 6 cached pages, 2 free
    a = _req("a", list(range(100, 126)), max_tokens=4)  # 7 pages at the end
    _drain_one(sched, a)
    assert sched.num_preemptions == 0 and sched.prefix_cache.stats.evicted_tokens > 0


def test_n_sequences_prefill_the_prompt_once():
    sched = _sched(64)
    prompt = list(range(18))
    reqs = [_req(f"g{i}", prompt, max_tokens=3, n=3, index=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    first = _step(sched)
    assert first.requests == reqs[:1] and first.num_new_tokens == [18]
    second = _step(sched)  # beside the first one's decode
    assert second.requests == reqs and second.num_new_tokens == [1, 2, 2]
    assert reqs[1].pages[:4] == reqs[0].pages[:4] == reqs[2].pages[:4]
    _drain(sched)
    assert sched.pages.num_free + sched.prefix_cache.num_pages == 64


@pytest.mark.parametrize("cache", [True, False])
def test_random_traffic_leaves_the_pool_whole(cache: bool):
    """Shared prefixes, random lengths and aborts through a pool that forces eviction and
    preemption; every refcount ends at the cache's one reference (zero once flushed)."""
    rng = random.Random(0)
    sched = _sched(24, budget=32, cache=cache)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    live: list[Request] = []
    for i in range(400):
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        req = _req(f"r{i}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 12))
        req.group_id = req.request_id
        sched.add(req)
        live.append(req)
        _step(sched)
        if rng.random() < 0.1:
            sched.abort(rng.choice(live).group_id)
    _drain(sched)
    assert all(r.finished for r in live) and sched.num_preemptions > 0
    pool = sched.pages
    held = sched.prefix_cache.pages() if cache else []
    assert all(pool.refcount(p) == (p in held) for p in range(pool.num_pages))
    assert pool.num_cache_only == len(held)
    if cache:
        assert sched.prefix_cache.stats.evicted_tokens > 0
        assert sched.prefix_cache.stats.cached_tokens > 0
        sched.prefix_cache.reset()
    assert pool.num_free == pool.num_pages


def test_1000_requests_with_aborts_through_the_engine(tmp_path, smollm2_path):
    """A tiny random Llama, 1000 short requests over a few shared prefixes, random aborts and
    a pool of 40 pages of 4 tokens: eviction and preemption both happen; afterwards no request
    holds a page and flushing the cache returns every page."""
    from oracle import assert_pool_whole
    from test_models import tiny_hf_model

    from pcgspec import LLM

    tiny_hf_model("LlamaConfig").save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        tokenizer=str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=P,
        max_total_tokens=40 * P,
        max_running_requests=16,
        chunked_prefill_size=24,
        piecewise_cuda_graph_max_tokens=64,
    )
    engine, rng = llm.engine, random.Random(1)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(4, 40))] for _ in range(8)]
    added = []
    while len(added) < 1000 or engine.has_unfinished:
        for _ in range(3 if len(added) < 1000 else 0):
            tail = [rng.randrange(256) for _ in range(rng.randrange(1, 6))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                ignore_eos=True,
                max_tokens=rng.randrange(1, 10),
                n=rng.choice([1, 1, 1, 2]),
            )
            added += engine.add_request(rng.choice(prefixes) + tail, params)
        engine.step()
        if rng.random() < 0.1:
            engine.abort(rng.choice(added).group_id)
    assert all(r.finished for r in added)
    assert {r.finish_reason for r in added} == {"length", "abort"}
    stats = engine.cache_stats()
    assert engine.scheduler.num_preemptions > 0 and stats["evicted_tokens"] > 0
    assert stats["hit_rate"] > 0.3 and engine.graph_stats()["piecewise"]["runs"] > 0
    assert engine.slots.num_free == engine.slots.num_slots
    assert_pool_whole(engine)


def test_held_leaves_are_not_popped_at_every_eviction():
    """A leaf a request holds counts as used when an eviction passes it: 5,000 one-page
    evictions with 2,000 held leaves older than every other pop each held leaf about once,
    not once per eviction (10 M pops)."""
    import heapq
    from unittest import mock

    held_n, free_n = 2_000, 5_000
    pool, cache = _cache(num_pages=held_n + free_n)
    held = [_insert(pool, cache, [i] * P) for i in range(held_n)]
    for pages in held:
        pool.incref(pages)
    for i in range(free_n):
        _insert(pool, cache, [held_n + i] * P)
    pops = 0
    real_pop = heapq.heappop

    def counting_pop(heap):
        nonlocal pops
        pops += 1
        return real_pop(heap)

    with mock.patch("pcgspec.engine.radix_cache.heapq.heappop", counting_pop):
        assert sum(cache.evict(1) for _ in range(free_n)) == free_n
    assert pops < 3 * (held_n + free_n), pops
    assert cache.num_pages == held_n  # every held page stays
    for pages in held:
        pool.free(pages)
    assert cache.evict(held_n) == held_n and pool.num_free == held_n + free_n
