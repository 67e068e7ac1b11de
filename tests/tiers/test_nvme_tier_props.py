"""Property tests of the nvme tier over random operation sequences (hypothesis state machine).

The store reader here is deterministic: reads complete only when the test says so (in issue order, as reader
threads finish), a record can be made to fail (an I/O error after the reader's retries) or to stall (waiting on
its read times out at once), and a stalled read, when finally let go, writes its record into the slot it was
given, as a late O_DIRECT read would. Copies between tiers are deferred on two streams (tests/tiers/test_tiers_props.py).
A failed read leaves garbage in its buffer, and so does a read that completes after a wait on it timed out (the
tier must have given that slot up). So a read marked resident before it landed, a slot reused under a read still
writing into it, or a failed read taken for data, each leave wrong bytes where the checks look. After every step:
the tier rules, exclusivity, every readable expert equal to its store record, the arena within budget, faults
only on records made to fail. Layer steps are the real step (glm53.step.stepper.MoeStepper with nvme=the tier,
through tests/support/step_layer.py): decode steps teach the policy, admit when admitting and make RAM room after
launch; prefill steps stage every pick, read the next layer ahead, and neither teach nor admit.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import cache
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from nvme_support import make_store
from policy_lab import use_policy
from step_layer import step_layer, stepper_for
from test_tiers_props import DeferredCopier

from glm53.tiers import TierError, Where, direct_moe
from glm53.tiers.nvme import NvmeTier
from glm53.tiers.policy import ScoredPolicy
from store.errors import StoreError, StoreReadError
from store.format import read_header
from store.reader import ReadDone

LAYERS, EXPERTS, HIDDEN = 2, 6, 64


@cache
def store_file() -> Path:
    root = Path(tempfile.mkdtemp(prefix="glm53-nvme-props-"))
    atexit.register(shutil.rmtree, root, True)
    return make_store(root, layers=LAYERS + 1, experts=EXPERTS, hidden=HIDDEN, inter=32)[1]


class LazyRead(Future):
    """A read that happens when it is waited for (or when the test completes it), unless its record stalls."""

    def __init__(self, reader: DeferredReader, key: tuple[int, int], out: np.ndarray):
        super().__init__()
        self.reader, self.key, self.out = reader, key, out
        self.timed_out = False

    def result(self, timeout=None):
        if not self.done():
            if self.key in self.reader.stuck:
                self.timed_out = True
                raise FutureTimeout()
            self.reader.complete(self)
        return super().result(0)


class DeferredReader:
    def __init__(self, path: Path):
        self.path = path
        self.header = read_header(path)
        self.max_extent = self.header.max_extent
        data = path.read_bytes()
        self.records = {k: data[e.offset:e.offset + e.extent] for k, e in self.header.index.items()}
        self.pending: list[LazyRead] = []
        self.stuck: set[tuple[int, int]] = set()
        self.broken: set[tuple[int, int]] = set()

    def read(self, layer, expert, out, *, priority=None, verify=None):
        f = LazyRead(self, (layer, expert), out)
        self.pending.append(f)
        return f

    def complete(self, f: LazyRead) -> None:
        self.pending.remove(f)
        if not f.set_running_or_notify_cancel():  # cancelled while queued: a real reader never reads it
            return
        e = self.header.entry(*f.key)
        if f.key in self.broken or f.timed_out:
            f.out[:e.extent] = 0xEE  # what a failed or given-up read leaves behind is anyone's guess
        if f.key in self.broken:
            f.set_exception(StoreReadError(f"store {self.path}: {e.where()}: I/O error, after 3 attempts", "repack"))
            return
        if not f.timed_out:
            f.out[:e.extent] = np.frombuffer(self.records[f.key], np.uint8)
        f.set_result(ReadDone(*f.key, f.out[:e.extent], 1, 0.0))

    def close(self) -> None:
        pass


def forward(slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cheap, but a function of the slot's bytes: x scaled by the gate's suh vector read from the slot."""
    return x * TIER_LAYOUT[0].views(slot)["gate.suh"].float()


TIER_LAYOUT: list = []
layers = st.integers(0, LAYERS - 1)
experts = st.integers(0, EXPERTS - 1)
pairs = st.tuples(layers, experts)


class NvmeMachine(RuleBasedStateMachine):
    @initialize(vram=st.lists(st.integers(0, EXPERTS), min_size=LAYERS, max_size=LAYERS), spare=st.integers(0, 4),
                counts=st.none() | st.lists(st.floats(0, 50), min_size=LAYERS * EXPERTS, max_size=LAYERS * EXPERTS))
    def start(self, vram, spare, counts):
        self.reader = DeferredReader(store_file())
        self.copier = DeferredCopier()
        self.tier = NvmeTier(self.reader, EXPERTS, vram, EXPERTS + 1 + spare, copier=self.copier, timeout_s=1.0,
                             window=4, staging_slots=EXPERTS)
        use_policy(self.tier.tiers, lambda n: ScoredPolicy(n, margin=0.0))
        TIER_LAYOUT[:] = [self.tier.layout]
        lo = self.tier.tiers.ram.storage.data_ptr()
        hi = lo + self.tier.tiers.ram.storage.numel()
        self.copier.is_ram = lambda t: lo <= t.data_ptr() < hi
        self.images = {k: torch.from_numpy(np.frombuffer(v, np.uint8)[: self.tier.layout.nbytes].copy())
                       for k, v in self.reader.records.items()}
        self.ever_failed: set[tuple[int, int]] = set()
        self.clogged: set[tuple[int, int]] = set()  # records a step could not read while stalled reads held RAM
        self.tier.warm(None if counts is None else np.array(counts).reshape(LAYERS, EXPERTS))
        self.stepper = stepper_for(self.tier.tiers, EXPERTS, nvme=self.tier)

    def image(self, layer: int, e: int) -> torch.Tensor:
        return self.images[(self.tier.store_layers[layer], e)]

    @rule(layer=layers, picks=st.lists(st.lists(experts, min_size=2, max_size=2, unique=True), min_size=1, max_size=3),
          decode=st.booleans(), admit=st.booleans())
    def step(self, layer, picks, decode, admit):
        ids = np.array(picks)
        x = torch.arange(len(picks) * HIDDEN, dtype=torch.float32).reshape(len(picks), HIDDEN)
        w = torch.full(ids.shape, 0.5)
        self.stepper.admit = admit
        try:
            got, _ = step_layer(self.tier.tiers, self.stepper, layer, x, ids, w, forward, decode=decode)
        except StoreError as exc:  # only a record made to fail or stall may fail a step, and it is named
            if "held by reads that stalled" in exc.problem:  # or any, once stalled reads hold every free slot
                assert self.tier.tiers.ram.retired() > 0
                self.clogged |= {(self.tier.store_layers[layer], int(e)) for e in np.unique(ids)}
                return
            bad = [e for e in np.unique(ids) if (self.tier.store_layers[layer], int(e)) in self.ever_failed]
            assert bad, f"a step failed on good records: {exc}"
            assert any(f"expert {e})" in exc.problem for e in bad)
            return
        assert torch.equal(got, direct_moe(x, ids, w, lambda e: self.image(layer, e), forward))

    @rule(picks=st.lists(pairs, max_size=6))
    def prefetch(self, picks):
        self.tier.prefetch(picks)

    @rule(nearest=layers)
    def prefetch_prefill(self, nearest):
        self.tier.prefetch_prefill(list(range(nearest, LAYERS)), window=EXPERTS)

    @rule(n=st.integers(1, 4))
    def reads_complete(self, n):
        for f in [f for f in self.reader.pending if f.key not in self.reader.stuck][:n]:
            self.reader.complete(f)

    @rule(key=pairs)
    def record_breaks(self, key):
        k = (self.tier.store_layers[key[0]], key[1])
        self.reader.broken.add(k)
        self.ever_failed.add(k)

    @rule(key=pairs)
    def record_stalls(self, key):
        k = (self.tier.store_layers[key[0]], key[1])
        self.reader.stuck.add(k)
        self.ever_failed.add(k)

    @rule()
    def disk_recovers(self):
        self.reader.broken.clear()
        self.reader.stuck.clear()

    @rule()
    def poll(self):
        self.tier.poll()

    @rule(queue=st.integers(0, 1), n=st.integers(1, 3))
    def copies_land(self, queue, n):
        for _ in range(n):
            self.copier.step(queue)

    @rule(layer=layers, expert=experts)
    def evict(self, layer, expert):
        t = self.tier.tiers
        if t.where[layer, expert] != Where.VRAM:
            return
        before = t.where.copy()
        try:
            t.evict(layer, expert)
        except TierError:  # RAM full of experts that cannot be dropped: refused, nothing changed
            assert np.array_equal(t.where, before)

    @invariant()
    def tier_rules(self):
        tier, t = self.tier, self.tier.tiers
        tier.check_invariants()
        assert tier.resident_bytes() <= tier.budget_bytes
        for layer in range(LAYERS):
            vl = t.vram[layer]
            held_vram = set(vl.owner[(vl.owner >= 0) & ~vl.pending].tolist())
            held_ram = {e for e in range(EXPERTS) if t.ram.holds(layer, e)}
            assert not held_vram & held_ram, "an expert is resident in VRAM and RAM at once"
            for e in range(EXPERTS):
                if t.where[layer, e] in (Where.VRAM, Where.RAM, Where.TO_VRAM):
                    assert torch.equal(t.bytes_of(layer, e), self.image(layer, e)), f"{layer}/{e} bytes wrong"
            for e, slot in enumerate(vl.router_map.tolist()):
                if slot != vl.absent:
                    assert torch.equal(vl.flat(slot), self.image(layer, e)), "router map points at bytes not landed"
        health = tier.health()
        for f in health["faults"] if health else []:
            key = (f["store_layer"], f["expert"])
            assert key in self.ever_failed | self.clogged, "a fault on a record that never failed"

    def teardown(self):
        if not hasattr(self, "tier"):
            return
        # The disk recovers and every read and copy finishes: retired slots come back, nothing is in flight.
        self.disk_recovers()
        for f in list(self.reader.pending):
            self.reader.complete(f)
        self.tier.poll()
        self.tier.tiers.settle_all()
        self.tier.poll()
        self.tier_rules()
        t = self.tier.tiers
        assert t.ram.retired() == 0 and not (t.where == Where.FROM_STORE).any()
        assert np.isin(t.where, [Where.VRAM, Where.RAM, Where.STORE]).all()


NvmeMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_nvme_tier_rules = NvmeMachine.TestCase
