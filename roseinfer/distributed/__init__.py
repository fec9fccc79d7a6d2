"""Tensor parallelism: one model split over N processes (docs/scaling-out.md, Tensor parallel).

Rank 0 is the engine's own process: it keeps the scheduler, sampler and detokenizers
and holds shard 0; ranks 1..N-1 are worker processes (``worker``) that only run their
shard.  Files, in the order a step meets them:

* ``plan``: what each rank holds (heads, MLP channels, vocabulary) or why it cannot;
* ``shard``: a rank's model loaded from its parts of the checkpoint;
* ``comm``: the rendezvous and the process groups (gloo / NCCL), explicit objects;
* ``layers``: the collectives inside a shard (row-parallel all-reduce, vocab-parallel
  embedding);
* ``step``: the step message rank 0 broadcasts and what every rank runs;
* ``runner``: rank 0's ``TensorParallelRunner`` (``ModelRunner.execute``'s interface),
  which starts, watches and stops the workers (``pool``: ``roseinfer tp-worker``
  subprocesses running ``worker``);
* ``spec``: the JSON document a worker reads (validated field by field), and ``auth``:
  the group's secret and the signed store every value goes through;
* ``errors``: every failure is fatal to the engine (``ModelFailedError``).
"""
