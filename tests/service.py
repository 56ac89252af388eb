"""Service: something a test starts and stops (a Slurm cluster, hosts of namespaces), used as
``with Thing(...) as thing:``; a start that fails half-way is cleaned up by its stop."""
from __future__ import annotations


class Service:
    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Undo whatever part of start() happened (it may have failed half-way)."""
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
