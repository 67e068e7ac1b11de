"""Property tests of the tier rules over random sequences of operations (hypothesis state machine).

The copier here defers every copy until the test lands it, on two independent queues like the fill and write-back
copy streams: an expert marked resident too early, or a fill overtaking the write-back that still reads its slot,
would leave someone else's bytes where the content checks look. After every step: exclusivity, nothing lost or
duplicated, only landed experts in the router map, every readable expert's bytes equal to the source (so write-backs
really wrote back). Layer steps are the real step (glm53.step.stepper.MoeStepper through
tests/support/step_layer.py), decode or prefill, admitting or not; their copies (staging, admissions from staging)
are deferred like the rest, the kernels waiting for them.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from policy_lab import use_policy
from step_layer import step_layer, stepper_for

from glm53.tiers import Copier, ExpertTiers, SlotLayout, TierError, Where, direct_moe
from glm53.tiers.policy import ScoredPolicy

LAYERS, EXPERTS = 2, 6
LAYOUT = SlotLayout.packed([("w", torch.float32, (4, 4))], align=16)


class DeferredTicket:
    def __init__(self, copier: DeferredCopier, queue: int, seq: int, dst, src, after: DeferredTicket | None):
        self.copier, self.queue, self.seq = copier, queue, seq
        self.dst, self.src, self.after = dst, src, after

    def done(self) -> bool:
        return self.copier.executed[self.queue] > self.seq

    def wait(self) -> None:
        self.copier.run_to(self)


class DeferredCopier(Copier):
    """Two copy streams that run only when told to: fills (to VRAM) and write-backs (to RAM), each in its own
    issue order, independent of the other except where a copy names `after` (like cudaStreamWaitEvent). A copy
    marked landed too early, or a fill not ordered after the write-back reading its slot, shows up as wrong bytes.
    """

    def __init__(self):
        super().__init__("cpu")
        self.queues: tuple[list[DeferredTicket], list[DeferredTicket]] = ([], [])
        self.executed = [0, 0]
        self.is_ram = lambda t: False  # set once the RAM arena exists: copies into it are write-backs

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> DeferredTicket:
        q = 1 if self.is_ram(dst) else 0
        t = DeferredTicket(self, q, len(self.queues[q]), dst, src, after)
        self.queues[q].append(t)
        return t

    def step(self, q: int) -> bool:
        """Run the head of queue q unless it waits on a copy not landed yet (a stream blocked on an event)."""
        if self.executed[q] == len(self.queues[q]):
            return False
        head = self.queues[q][self.executed[q]]
        if head.after is not None and not head.after.done():
            return False
        head.dst.copy_(head.src)
        self.executed[q] += 1
        return True

    def run_to(self, t: DeferredTicket) -> None:
        while not t.done():
            head = self.queues[t.queue][self.executed[t.queue]]
            if head.after is not None:
                self.run_to(head.after)  # issued earlier, so this recursion ends
            self.step(t.queue)


def source_bytes() -> torch.Tensor:
    out = torch.zeros((LAYERS, EXPERTS, LAYOUT.nbytes), dtype=torch.uint8)
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            LAYOUT.views(out[layer, e])["w"].copy_(torch.full((4, 4), float(100 * layer + e)))
    return out


def expert_forward(slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ LAYOUT.views(slot)["w"]


layers = st.integers(0, LAYERS - 1)
experts = st.integers(0, EXPERTS - 1)


class TierMachine(RuleBasedStateMachine):
    @initialize(
        keep_all=st.booleans(),
        vram=st.lists(st.integers(0, EXPERTS), min_size=LAYERS, max_size=LAYERS),
        spare=st.integers(0, 4),
        counts=st.none() | st.lists(st.floats(0, 50), min_size=LAYERS * EXPERTS, max_size=LAYERS * EXPERTS),
    )
    def start(self, keep_all, vram, spare, counts):
        self.src = source_bytes()
        self.copier = DeferredCopier()
        ram = LAYERS * EXPERTS - sum(vram) + 1 + spare if keep_all else EXPERTS + 1 + spare
        self.tiers = ExpertTiers(
            LAYOUT, EXPERTS, vram, ram, keep_all=keep_all, copier=self.copier,
            fetch=lambda lay, e, out: out.copy_(self.src[lay, e]), staging_slots=EXPERTS,
        )
        use_policy(self.tiers, lambda n: ScoredPolicy(n, margin=0.0))
        lo = self.tiers.ram.storage.data_ptr()
        hi = lo + self.tiers.ram.storage.numel()
        self.copier.is_ram = lambda t: lo <= t.data_ptr() < hi
        self.counts = None if counts is None else np.array(counts).reshape(LAYERS, EXPERTS)
        self.tiers.populate(lambda lay, e, out: out.copy_(self.src[lay, e]), self.counts)
        if self.counts is not None:  # warm start: each layer's VRAM holds its most-picked experts
            for layer, s in enumerate(vram):
                top = np.argsort(-self.counts[layer], kind="stable")[:s]
                assert set(np.flatnonzero(self.tiers.vram[layer].resident())) == set(top.tolist())
        self.stepper = stepper_for(self.tiers, EXPERTS)

    @rule(layer=layers, expert=experts, data=st.data())
    def admit(self, layer, expert, data):
        t, vl = self.tiers, self.tiers.vram[layer]
        residents = np.flatnonzero(vl.resident()).tolist()
        victim = data.draw(st.sampled_from(residents)) if residents and not vl.free_slots().size else None
        before = t.where.copy()
        no_room = t.keep_all and t.ram.free_count() == 0 and not any(mv.to_vram for mv in t._moves.values())
        try:
            t.admit(layer, expert, victim)
        except TierError:
            # Refused: not in RAM, no slot, or (all-RAM mode, spare used by bare evictions) no room for the victim.
            assert before[layer, expert] != Where.RAM or (victim is None and not vl.free_slots().size) or no_room
            assert np.array_equal(t.where, before), "a refused admission changed state"
            return
        assert before[layer, expert] == Where.RAM
        assert t.where[layer, expert] == Where.TO_VRAM and vl.slot_of[expert] == -1  # not resident before landing
        if victim is not None:
            assert t.where[layer, victim] == Where.TO_RAM

    @rule(layer=layers, expert=experts)
    def evict(self, layer, expert):
        t = self.tiers
        if t.where[layer, expert] != Where.VRAM:
            return
        if t.keep_all and t.ram.free_count() == 0 and not any(mv.to_vram for mv in t._moves.values()):
            try:  # all-RAM mode with the spare used up: refused, and nothing changed
                t.evict(layer, expert)
            except TierError:
                assert t.where[layer, expert] == Where.VRAM
                return
            raise AssertionError("eviction without room in RAM was accepted")
        t.evict(layer, expert)
        assert t.where[layer, expert] == Where.TO_RAM

    @precondition(lambda self: not self.tiers.keep_all)
    @rule(layer=layers, expert=experts)
    def fetch(self, layer, expert):
        if self.tiers.where[layer, expert] == Where.STORE:
            self.tiers.fetch_to_ram(layer, expert)
            assert self.tiers.where[layer, expert] == Where.RAM

    @rule(queue=st.integers(0, 1), n=st.integers(1, 3))
    def copies_land(self, queue, n):
        for _ in range(n):
            self.copier.step(queue)

    @rule()
    def poll(self):
        self.tiers.poll()

    @rule(layer=layers, expert=experts)
    def settle(self, layer, expert):
        self.tiers.settle(layer, expert)
        assert self.tiers.where[layer, expert] not in (Where.TO_VRAM, Where.TO_RAM)

    @rule(layer=layers, picks=st.lists(st.lists(experts, min_size=2, max_size=2, unique=True), min_size=1, max_size=3),
          decode=st.booleans(), admit=st.booleans())
    def step(self, layer, picks, decode, admit):
        """One layer step: decode (teaches the policy; admits the streamed misses it wants, when admitting) or
        prefill (stages every pick, residents too, and neither teaches nor admits)."""
        ids = np.array(picks)
        x = torch.arange(len(picks) * 4, dtype=torch.float32).reshape(len(picks), 4)
        w = torch.full(ids.shape, 0.5)
        self.stepper.admit = admit
        got, _ = step_layer(self.tiers, self.stepper, layer, x, ids, w, expert_forward, decode=decode)
        assert torch.equal(got, direct_moe(x, ids, w, lambda e: self.src[layer, e], expert_forward))

    @invariant()
    def tier_rules(self):
        t = self.tiers
        t.check_invariants()
        for layer in range(LAYERS):
            vl = t.vram[layer]
            held_vram = set(vl.owner[(vl.owner >= 0) & ~vl.pending].tolist())
            held_ram = {e for e in range(EXPERTS) if t.ram.holds(layer, e)}
            moving = {e for (lay, e) in t._moves if lay == layer}
            assert not held_vram & held_ram, "an expert is resident in VRAM and RAM at once"
            if t.keep_all:  # never lost: every expert is somewhere, or on its way between tiers
                assert held_vram | held_ram | moving == set(range(EXPERTS))
            for e in range(EXPERTS):
                if t.where[layer, e] in (Where.VRAM, Where.RAM, Where.TO_VRAM):
                    assert torch.equal(t.bytes_of(layer, e), self.src[layer, e]), f"{layer}/{e} bytes wrong"
            for e, slot in enumerate(vl.router_map.tolist()):
                if slot != vl.absent:
                    assert torch.equal(vl.flat(slot), self.src[layer, e]), "router map points at bytes not landed"

    def teardown(self):
        if hasattr(self, "tiers"):  # everything lands eventually, and then every expert is readable
            self.tiers.settle_all()
            self.tier_rules()
            for layer in range(LAYERS):
                for e in range(EXPERTS):
                    w = self.tiers.where[layer, e]
                    assert w in (Where.VRAM, Where.RAM) or (w == Where.STORE and not self.tiers.keep_all)


TierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tier_rules = TierMachine.TestCase
