"""The order in which the authors' trainer (their veRL fork) puts a step's rows into mini-batches,
for train.py's --verl-minibatches (on in --preset paper).

Their trainer splits the batch over its 4 GPUs into parts of equal row counts and balanced token
counts (Karmarkar-Karp's largest differencing, `_balance_batch`), keeps each part in row order,
and each GPU splits its part in order, without a shuffle: update k takes the k-th slice of every
part. A group's rows are consecutive, so they share an update more often than shuffled rows do:
at the paper's size two rows of a group 44% of the time against 10% (tests/test_authors.py).
train.py shuffles instead, unless asked for this order.
"""
import heapq

import torch


class _State(list):
    """A partition of some of the rows: its parts, each [tokens, rows, [(row, length), ...]],
    largest first, compared as the authors' sets are: tokens, then rows, then the items."""

    def __lt__(self, other):
        # heapq pops the smallest: the widest spread comes first, then the largest first part
        return (self[0][0] - self[-1][0], self[0]) > (other[0][0] - other[-1][0], other[0])


def balanced_parts(lengths: list[int], parts: int) -> list[list[int]]:
    """Karmarkar-Karp into `parts` lists of len(lengths) / parts rows each, as the authors'
    `get_seqlen_balanced_partitions(..., equal_size=True)` computes it, ties broken alike:
    rows sorted by length go in runs of `parts` (one row to each part), and the two partitions of
    widest spread merge, largest part with smallest, until one is left -> row indices, each list
    in row order."""
    rows = sorted((n, i) for i, n in enumerate(lengths))
    heap = [_State(sorted(([n, 1, [(i, n)]] for n, i in rows[s:s + parts]), reverse=True))
            for s in range(0, len(rows), parts)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, _State(sorted(([x[0] + y[0], x[1] + y[1], x[2] + y[2]]
                                            for x, y in zip(a, reversed(b))), reverse=True)))
    return [sorted(i for i, _ in part[2]) for part in heap[0]]


def verl_order(lengths, mini_batch_size: int, parts: int = 4) -> torch.Tensor:
    """The rows in the authors' mini-batch order: lengths (N,) -> (N,) long, whose consecutive
    runs of mini_batch_size are their updates' rows. `parts`: their GPUs; it must divide
    mini_batch_size, which must divide N (train.py checks both at the command line)."""
    split = balanced_parts(lengths.tolist(), parts)
    share = mini_batch_size // parts
    return torch.tensor([row for k in range(0, len(split[0]), share)
                         for part in split for row in part[k:k + share]])
