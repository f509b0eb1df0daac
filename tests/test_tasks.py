"""Background tasks of a server's driver: settling them ends whatever the event loop's task factory."""

from __future__ import annotations

import asyncio
import threading

from slotkeeper.drivers.tasks import Tasks


def test_settle_ends_when_the_tasks_ended_before_their_done_callbacks_ran():
    """Python 3.12's eager tasks run to their end inside `create_task`, and its `gather` of tasks that have all
    ended returns without yielding to the loop: `settle` spun forever on a finished probe (a simulator seed hung
    CI's 3.12 pair). Run in a thread so that a regression fails here instead of hanging the suite."""
    ended: list[bool] = []

    async def quick() -> int:
        return 1

    async def main() -> None:
        factory = getattr(asyncio, "eager_task_factory", None)  # Python 3.12+
        if factory is not None:
            asyncio.get_running_loop().set_task_factory(factory)
        tasks = Tasks()
        for _ in range(3):
            tasks.spawn(quick())
        await tasks.settle()
        ended.append(True)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    thread.join(5)
    assert ended == [True]
