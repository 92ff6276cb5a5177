"""Speculative decoding's scheduler (engine/speculative.py) against a fake model over a simulated KV cache.

The fake model's next token is a fixed function of the tokens before it, so every run has one right answer: the
tokens a plain decode loop produces. The fake runner writes each fed token into a slot map (slot -> the
position and token written there) and, before a chunk runs, checks every position its queries read: each must
hold the sequence's own accepted token. That is the assertion that no rejected token's KV is ever read, through
verify steps, trims, preemptions, chunked prefill and prefix-cache hits (a hit on a block keyed over a rejected
token would read it). Two more checks on the prefix cache: a verify row's keyed blocks end before its newest
token (the slot its step writes), and once a step's writes landed every keyed block holds the tokens its key
was hashed from. Acceptance is the runner's own (runner/spec_verify.py, `accept`).

With a draft model (--speculative-method draft) the fake runner keeps a second slot map, the draft's cache, and
fills the placeholders as the draft would (runner/draft.py): it feeds each verify row's draft_prefix and last
token, then its proposals but the last, checking the same two things for the draft's cache (what it reads holds
the accepted tokens, every keyed block holds its key's tokens) through full acceptance, preemption and
prefix-cache hits. Its proposals are the right tokens except at every position p with p % 5 == 3, so runs are
accepted whole (the draft then lags one position), cut mid-way, and rejected at once."""

import random
from dataclasses import replace

import pytest

from ostinato.config import CacheConfig, SchedulerConfig
from ostinato.contract import SchedulerOutput, StepResult, SampledToken
from ostinato.engine import blocks
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.speculative import SpecScheduler, split_rounds
from ostinato.runner.spec_verify import accept, logit_rows
from ostinato.sampling_params import SamplingParams
from ostinato.speculative_config import SpeculativeConfig

VOCAB = 5
EOS = 4
KEYS: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}  # block key -> (parent key, its block's tokens)


@pytest.fixture(autouse=True)
def record_keys(monkeypatch):
    """Record what each block key stands for as the block manager hashes it."""
    real = blocks.hash_block

    def recording(parent, token_ids, salt=b""):
        key = real(parent, token_ids, salt)
        KEYS[key] = (parent, tuple(token_ids))
        return key

    monkeypatch.setattr(blocks, "hash_block", recording)


def make_model(seed):
    """next token = table[last two tokens]: sequences fall into loops, so prompt lookup proposes well, and often
    wrongly before they do."""
    rng = random.Random(seed)
    table = [rng.randrange(VOCAB) for _ in range(VOCAB * VOCAB)]
    return lambda tokens: table[tokens[-1] * VOCAB + tokens[-2]]


def reference(model, prompt, max_tokens, eos):
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if t == eos:
            break
    return out


class FakeRunner:
    def __init__(self, model, sched, block_size, draft=False):
        self.model, self.sched, self.bs = model, sched, block_size
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token) last written there
        self.draft_kv: dict[int, tuple[int, int]] | None = {} if draft else None  # the draft model's cache
        self.read_positions = 0
        self.keyed_checked = 0

    def check_reads(self, kv, chunk, end, true, what):
        for p in range(end):
            assert kv.get(self.slot(chunk.block_table, p)) == (p, true[p]), \
                f"{what} of seq {chunk.seq_id} reads position {p}, which does not hold its accepted token"
            self.read_positions += 1

    def write(self, kv, chunk, start, tokens):
        for j, tok in enumerate(tokens):
            kv[self.slot(chunk.block_table, start + j)] = (start + j, tok)

    def propose(self, out: SchedulerOutput) -> SchedulerOutput:
        """The draft's part of the step: prompt chunks written to its cache; each verify row's draft_prefix and
        last token, then its proposals but the last, with the placeholders filled."""
        seqs = []
        for c in out.seqs:
            true = self.sched.get(c.seq_id).all_token_ids
            start = c.start_pos - len(c.draft_prefix)
            self.check_reads(self.draft_kv, c, start, true, "the draft")
            if not c.verify:
                self.write(self.draft_kv, c, start, c.token_ids)
                seqs.append(c)
                continue
            assert tuple(true[start:c.start_pos]) == c.draft_prefix
            ctx = true[:c.start_pos + 1]
            proposals = []
            for _ in range(len(c.token_ids) - 1):
                t = self.model(ctx)
                proposals.append(t if len(ctx) % 5 != 3 else (t + 1) % VOCAB)
                ctx = ctx + [proposals[-1]]
            self.write(self.draft_kv, c, start, c.draft_prefix + c.token_ids[:1] + tuple(proposals[:-1]))
            seqs.append(replace(c, token_ids=(c.token_ids[0], *proposals)))
        return replace(out, seqs=tuple(seqs))

    def check_keyed_blocks(self):
        """Once a step's writes landed, every block the prefix cache keys holds its key's tokens: a key never
        covers a rejected token's slot, nor one not yet written (the key's tokens: KEYS, recorded as hashed)."""
        alloc = self.sched.block_manager.allocator
        for block in range(alloc.num_total):
            key = alloc.key_of(block)
            if key is None:
                continue
            tokens = []
            while key is not None:
                key, own = KEYS[key]
                tokens[:0] = own
            first = len(tokens) - self.bs
            for kv in (self.kv, self.draft_kv) if self.draft_kv is not None else (self.kv,):
                for off in range(self.bs):
                    assert kv.get(block * self.bs + off) == (first + off, tokens[first + off]), \
                        f"block {block} is keyed over position {first + off}, which does not hold the key's token"
                    self.keyed_checked += 1

    def slot(self, table, pos):
        return table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, out: SchedulerOutput) -> StepResult:
        drawn = []
        if self.draft_kv is not None:
            out = self.propose(out)
        for c in out.seqs:
            true = self.sched.get(c.seq_id).all_token_ids
            assert len(c.block_table) * self.bs >= c.context_len, "a chunk's blocks cover its positions"
            # What its queries attend to, before this step's own tokens.
            self.check_reads(self.kv, c, c.start_pos, true, "the model")
            assert tuple(true[c.start_pos:c.start_pos + 1]) == c.token_ids[:1]
            if c.verify:  # its keyed blocks end before its newest token, whose slot this step writes (again)
                assert self.sched.get(c.seq_id).num_cached_blocks * self.bs <= c.start_pos
            for j, tok in enumerate(c.token_ids):
                self.kv[self.slot(c.block_table, c.start_pos + j)] = (c.start_pos + j, tok)
            ctx = true[:c.start_pos] + list(c.token_ids)
            if c.verify:
                drawn += [self.model(ctx[:c.start_pos + j + 1]) for j in range(len(c.token_ids))]
            elif c.samples:
                drawn.append(self.model(ctx))
        self.check_keyed_blocks()
        _, seqs = logit_rows(out.seqs)
        kept, ids, counts = accept(seqs, drawn)
        tokens = [drawn[i] for i in kept]
        return StepResult(ids, tokens, list(map(SampledToken, tokens)), spec=counts if seqs else None)


def run(prompts, *, k=3, block_size=2, num_blocks=64, max_num_seqs=4, budget=16, max_tokens=12, model_seed=0,
        prefix_caching=True, waves=1, eos=EOS, method="ngram"):
    model = make_model(model_seed)
    sched = SpecScheduler(SchedulerConfig(max_num_seqs, budget, 64),
                          CacheConfig(block_size, num_blocks, enable_prefix_caching=prefix_caching,
                                      prefix_cache_salt="m"),
                          SpeculativeConfig(method, k, 1, 3))
    runner = FakeRunner(model, sched, block_size, draft=method == "draft")
    results, accepted = {}, 0
    for wave in range(waves):
        seqs = []
        for i, prompt in enumerate(prompts):
            seq = Sequence(wave * 100 + i, f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
            sched.add(seq)
            seqs.append(seq)
        while sched.has_unfinished():
            result = runner.step(sched.schedule())
            accepted += result.spec.accepted if result.spec else 0
            for r in split_rounds(result):  # as the engine takes them: a sequence ends inside its run
                sched.update(r.seq_ids, r.token_ids)
                for sid, tok in zip(r.seq_ids, r.token_ids):
                    seq = sched.get(sid)
                    if seq is not None and (tok == eos or len(seq.output_token_ids) >= max_tokens):
                        sched.finish(sid, SequenceStatus.FINISHED_STOPPED)
        for i, seq in enumerate(seqs):
            results[(wave, i)] = seq.output_token_ids
            assert seq.output_token_ids == reference(model, prompts[i], max_tokens, eos), (wave, i)
        # Later waves: each prompt followed by some of its output (a different length for each), so the prefix
        # cache serves blocks that verify steps wrote, up to different places in them.
        prompts = [list(p) + results[(wave, i)][:3 + 5 * i] for i, p in enumerate(prompts)]
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "a block leaked"
    assert all(bm.allocator.refcount(b) == 0 for b in range(bm.num_total_blocks))
    return sched, runner, accepted


PROMPTS = [[0, 1, 2, 0, 1, 2, 0, 1], [3, 2, 1, 3, 2], [1, 1, 0, 2, 3, 1, 1], [2, 3]]


@pytest.mark.parametrize("model_seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_output_equals_plain_decoding_and_no_rejected_kv_is_read(model_seed, k):
    sched, runner, accepted = run(PROMPTS, k=k, model_seed=model_seed, waves=2)
    assert runner.read_positions > 0 and runner.keyed_checked > 0


@pytest.mark.parametrize("model_seed", range(3))
@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_models_cache_holds_the_accepted_tokens_wherever_it_is_read_or_keyed(model_seed, k):
    sched, runner, accepted = run(PROMPTS, k=k, model_seed=model_seed, waves=2, method="draft")
    assert runner.read_positions > 0 and runner.keyed_checked > 0 and accepted > 0


@pytest.mark.parametrize("model_seed", range(3))
def test_a_draft_models_cache_through_preemption_and_chunked_prefill(model_seed):
    sched, _, _ = run(PROMPTS, k=4, num_blocks=32, block_size=2, model_seed=model_seed, max_tokens=30, budget=8,
                      eos=-1, waves=2, method="draft")
    assert sched.num_preemptions > 0


def test_proposals_are_accepted_and_rejected_on_this_workload():
    """Both paths of the checks above run: across these models some proposals are accepted, some rejected."""
    totals = [run(PROMPTS, k=4, model_seed=s)[2] for s in range(6)]
    assert sum(totals) > 20


@pytest.mark.parametrize("model_seed", range(4))
def test_preemption_under_a_tiny_cache(model_seed):
    sched, _, _ = run(PROMPTS, k=4, num_blocks=32, block_size=2, model_seed=model_seed, max_tokens=30, budget=8,
                      eos=-1, waves=2)
    assert sched.num_preemptions > 0


def test_chunked_prefill_beside_verify_rows():
    long = [[i % 5 for i in range(30)], [0, 1, 2, 3] * 6, [2, 1]]
    run(long, k=3, budget=6, max_num_seqs=3, model_seed=3)


def test_rejected_blocks_go_back_after_the_step():
    """A row whose proposals take a block past its tokens and are all rejected gives that block back once the step
    is settled: it then holds exactly the blocks its tokens cover."""
    model = lambda tokens: 1  # noqa: E731  (the proposals, 2s, are never right)
    sched = SpecScheduler(SchedulerConfig(2, 16, 64), CacheConfig(2, 32), SpeculativeConfig("ngram", 4, 1, 1))
    runner = FakeRunner(model, sched, 2)
    seq = Sequence(0, "r", [1, 2, 2, 2, 2, 2, 0], SamplingParams(temperature=0, max_tokens=20))
    sched.add(seq)
    first = runner.step(sched.schedule())
    sched.update(first.seq_ids, first.token_ids)  # 8 tokens, the last (1) not in the cache yet
    out = sched.schedule()
    assert out.seqs[0].token_ids == (1, 2, 2, 2, 2)  # the 1 at position 0 was followed by 2s
    assert len(seq.block_table) == 6  # positions 7..11
    result = runner.step(out)
    assert result.spec == (1, 4, 0) and result.token_ids == [1]
    for r in split_rounds(result):
        sched.update(r.seq_ids, r.token_ids)
    out = sched.schedule()  # settles the verified row, then makes it a verify row again
    assert out.seqs[0].token_ids == (1, 1) and out.seqs[0].start_pos == 8  # the 1 at 7 was followed by a 1
    assert len(seq.block_table) == 5 and sched.block_manager.num_free_blocks == 32 - 5  # positions 0..9


def test_max_tokens_caps_the_proposals():
    """A row proposes at most max_tokens - outputs - 1 tokens, so a step never runs past max_tokens."""
    sched = SpecScheduler(SchedulerConfig(2, 16, 64), CacheConfig(2, 32), SpeculativeConfig("ngram", 8, 1, 2))
    seq = Sequence(0, "r", [1, 2, 1, 2, 1, 2, 1], SamplingParams(temperature=0, max_tokens=3))
    sched.add(seq)
    sched.schedule()
    sched.update([0], [2])
    out = sched.schedule()
    assert out.seqs[0].token_ids == (2, 1)  # its last token and 3 - 1 - 1 = 1 proposal
