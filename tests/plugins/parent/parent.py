from localm import sdk


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> int:
        self.value += 1
        return self.value


@sdk.hookimpl
def startup(host, plugin):
    host.provide("counter", Counter(), plugin=plugin.name)
