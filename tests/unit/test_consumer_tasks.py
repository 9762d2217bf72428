"""TaskRunner: the request thread's bookkeeping of extra tasks (group membership). Sans-IO,
driven with a fake task."""

from kera.consumer.tasks import TaskRunner
from kera.errors import NotOwner, Timeout


class FakeTask:
    """Asks for a heartbeat every `period` s; records what came back."""

    def __init__(self, period=1.0):
        self.period = period
        self.due = 0.0
        self.replies, self.errors = [], []

    def next_request(self, now):
        if now < self.due:
            return None
        self.due = now + self.period
        return "coord:1", ("heartbeat", {"member": "m1"})

    def on_reply(self, reply, now):
        self.replies.append(reply[0]["n"])

    def on_error(self, err, now):
        self.errors.append(err)

    def next_wake(self, now):
        return self.due


def test_one_request_at_a_time_and_the_reply_reaches_its_task():
    runner, task = TaskRunner(2.0), FakeTask()
    runner.add(task)
    (t, address, op, fields), = runner.requests(0.0)
    assert (t, address, op, fields) == (task, "coord:1", "heartbeat", {"member": "m1"})
    runner.sent(task, address, 41, 0.0)
    assert runner.requests(5.0) == []                     # still in flight
    assert not runner.on_reply("coord:1", {"id": 99, "ok": True}, [], 0.1)   # not its reply
    assert runner.on_reply("coord:1", {"id": 41, "ok": True, "n": 7}, [], 0.1)
    assert task.replies == [7] and len(runner.requests(1.5)) == 1


def test_error_reply_timeout_and_send_failure_reach_on_error():
    runner, task = TaskRunner(2.0), FakeTask()
    runner.add(task)
    runner.requests(0.0)
    runner.sent(task, "coord:1", 1, 0.0)
    runner.on_reply("coord:1", {"id": 1, "ok": False, "code": "not_owner", "message": "m",
                                "retriable": True}, [], 0.1)
    runner.requests(1.0)
    runner.sent(task, "coord:1", 2, 1.0)
    # Its request's deadline: the busy task's own next beat (2.0) waits for the reply.
    assert runner.next_wake(1.5) == 3.0
    runner.expire(2.9)
    assert len(task.errors) == 1
    runner.expire(3.0)
    runner.send_failed(task, Timeout("busy"), 3.0)
    assert [type(e) for e in task.errors] == [NotOwner, Timeout, Timeout]
    assert runner.pending == {} and len(runner.requests(3.0)) == 1
