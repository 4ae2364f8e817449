"""A gateway replica's pull of the workers' block logs before it routes a turn it did not see begin
(`WorkerPool.fresh_blocks`, several replicas without Redis), against real worker channels (StreamServer with a
BlockLog, the load-test backend): the turn's blocks were logged before the turn reached the gateway, so a pull
that started earlier (the poll's, finished or still in flight) is not enough; one that started later is."""
from __future__ import annotations

import asyncio

from cache.memory_index import MemoryPrefixIndex
from gateway.pool import WorkerPool
from policy.config import PulseConfig
from workers.blocklog import BlockLog
from workers.loadtest import LoadTestBackend
from workers.protocol import BlockEvent, WorkerInfo
from workers.stream import StreamServer

CONFIG = PulseConfig.model_validate({"workers": {"backend": "loadtest"}})


class SlowIndex(MemoryPrefixIndex):
    """Applies each event after a pause: a pull's answer is read long before the pull ends."""

    def __init__(self):
        super().__init__()
        self.applying = asyncio.Event()  # set once the worker has answered a pull

    async def apply(self, *args, **kwargs):
        self.applying.set()
        await asyncio.sleep(0.2)
        return await super().apply(*args, **kwargs)


async def _setup(index: MemoryPrefixIndex):
    log = BlockLog()
    srv = StreamServer(LoadTestBackend(CONFIG, worker_id="w0"), worker_id="w0", block_log=log)
    info = WorkerInfo("w0", await srv.start(), "loadtest", block_size=16, secret=srv.secret)

    async def discover(worker_id):
        return [info]

    pool = WorkerPool(discover, poll_interval_s=30, block_index=index, sync_blocks=True)
    await pool.start()
    return srv, pool, log


async def test_a_pull_that_ended_just_before_the_turn_is_pulled_again():
    index = MemoryPrefixIndex()
    srv, pool, log = await _setup(index)
    try:
        await pool.poll_once()  # the poll's pull, a moment before the last turn's blocks were logged
        log.add(BlockEvent(kind="added", hashes=[11, 12]))
        await pool.fresh_blocks()
        assert await index.longest_prefix([11, 12]) == {"w0": 2}
    finally:
        await pool.close()
        await srv.close()


async def test_a_pull_in_flight_since_before_the_turn_is_followed_by_one_all_waiters_share():
    index = SlowIndex()
    srv, pool, log = await _setup(index)
    try:
        log.add(BlockEvent(kind="added", hashes=[1]))
        polling = asyncio.create_task(pool.poll_once())
        await asyncio.wait_for(index.applying.wait(), 5)  # the poll's pull has its answer, and is still running
        log.add(BlockEvent(kind="added", hashes=[1, 2]))  # the last turn's blocks, after that answer
        pulls = []
        real = pool._pull_all_blocks

        async def counted():
            pulls.append(1)
            await real()
        pool._pull_all_blocks = counted
        assert not polling.done()
        await asyncio.gather(*(pool.fresh_blocks() for _ in range(5)))
        assert await index.longest_prefix([1, 2]) == {"w0": 2}
        assert len(pulls) == 1  # five waiters share one pull, after the one in flight
        assert polling.done()
    finally:
        await pool.close()
        await srv.close()

