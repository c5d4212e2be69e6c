"""A CompilePool worker that compiles nothing, in a module that imports nothing heavy: each spawned worker imports
it, and a replaced worker must start in seconds on a loaded two-core machine."""
import os


def fake_compile_worker(tasks, results):
    """A CompilePool worker that compiles nothing: ``die`` exits without a word, ``fatal`` reports and exits."""
    while True:
        task = tasks.get()
        if task is None:
            return
        if task["overrides"].get("die"):
            os._exit(3)
        fatal = bool(task["overrides"].get("fatal"))
        results.send((task["id"], dict(regs=task["id"], pid=os.getpid()), fatal))
        if fatal:
            return
