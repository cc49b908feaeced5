"""The prompt sampler: endless training questions, reshuffled every epoch from the run's seed;
(epoch, position) is its whole state, so a resumed run draws what the unbroken run would."""
import random


class PromptSampler:
    """Endless prompts, reshuffled every epoch from the seed; (epoch, pos) is its whole state."""

    def __init__(self, records: list[dict], seed: int, epoch: int = 0, pos: int = 0):
        if not records:   # next() would wait forever for a prompt
            raise ValueError("no training questions to sample prompts from")
        if pos >= len(records):   # the data shrank since the checkpoint: start the next epoch
            epoch, pos = epoch + 1, 0
        self.records, self.seed, self.epoch, self.pos = records, seed, epoch, pos

    def _order(self) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            order = self._order()
            take = order[self.pos:self.pos + n - len(out)]
            out += [self.records[i] for i in take]
            self.pos += len(take)
            if self.pos == len(order):
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}
