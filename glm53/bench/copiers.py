"""Copiers that stand in for the GPU's copy stream on the CPU, for the benchmarks and the tests: copies that do not
land by themselves (HeldCopier, GpuLikeCopier: a reader that does not wait for its copy reads the old bytes and the
test sees it), and copies whose tickets land at the next layer step (StepCopier: the host's cost of a stream-side
wait, for bench host-step --nvme)."""

from __future__ import annotations

from glm53.tiers import Copier


class HeldTicket:
    def __init__(self, copier: HeldCopier, index: int):
        self.copier, self.index = copier, index

    def done(self) -> bool:
        return self.copier.ran > self.index

    def wait(self) -> None:
        self.copier.run_to(self.index)


class HeldCopier(Copier):
    """One in-order copy stream that runs only when someone waits for a copy (then every copy before it runs
    too, as on a CUDA stream). Sources are read when the copy runs, as on the GPU: a source changed before its
    copy lands, or a copy chained on one still in flight (staging row -> VRAM slot), shows up in the bytes."""

    def __init__(self):
        super().__init__("cpu")
        self.queue: list = []
        self.ran = 0

    def copy(self, dst, src, after=None):
        if after is not None:
            after.wait()
        self.queue.append((dst, src))
        return HeldTicket(self, len(self.queue) - 1)

    def run_to(self, index: int) -> None:
        while self.ran <= index:
            dst, src = self.queue[self.ran]
            dst.copy_(src)
            self.ran += 1


class GpuLikeCopier(HeldCopier):
    """Held copies that the compute side waits for without the host landing them (a stream-side wait): they stay
    in flight until `gpu_runs`, as they would on a GPU still busy with earlier work."""

    def __init__(self):
        super().__init__()
        self.ordered: list = []

    def order_compute_after(self, tickets):
        self.ordered.extend(tickets)

    def gpu_runs(self) -> None:
        for t in self.ordered:
            t.wait()
        self.ordered.clear()


class StepTicket:
    __slots__ = ("copier", "issued", "landed")

    def __init__(self, copier: StepCopier, issued: int):
        self.copier, self.issued, self.landed = copier, issued, False

    def done(self) -> bool:
        return self.landed or self.copier.steps > self.issued

    def wait(self) -> None:
        self.landed = True


class StepCopier(Copier):
    """Copies that run at once on the CPU but whose tickets land only when the next layer step begins
    (`step_begins`) or someone waits on them; the compute side's waits on them are stream-side (no host wait)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.steps = 0

    def copy(self, dst, src, after=None):
        dst.copy_(src)
        return StepTicket(self, self.steps)

    def order_compute_after(self, tickets: list) -> None:
        """Deliberately no host wait: on the GPU the kernels wait for these copies on the device and the host goes
        on, which is the cost this benchmark measures (the copies land at the next step instead)."""

    def step_begins(self) -> None:
        self.steps += 1
