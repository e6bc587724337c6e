"""Stand-ins for a device's streams and events that write down, in order, what is asked of them:
the accelerator paths of block swap and the EMA run on the CPU with these (the machine has no
device), and the order of these calls is what keeps a device from reading memory before a copy
into it ends."""


class Event:
    def __init__(self, log: list):
        self.log = log

    def synchronize(self):
        self.log.append(("host", "synchronize", self))


class Stream:
    """A device stream's stand-in: its calls written to `log` in order."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def __enter__(self):
        self.log.append((self.name, "enter"))
        return self

    def __exit__(self, *exc):
        self.log.append((self.name, "exit"))

    def record_event(self):
        event = Event(self.log)
        self.log.append((self.name, "record", event))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event))
