"""The rank process the agent sees when the first attempt is preloaded (``resilience.proc.zygote``).

Run as ``python -u -S zygote_stub.py ZYGOTE CONFIG``: the standard library only, so that it starts in ~20 ms. On the
first attempt it asks the zygote to fork the rank with this process's stdio, environment and directory, relays
every signal it gets to the rank, and ends as the rank ended. No zygote to answer (it stops listening once it has
served the first attempt's ranks, unless ``supervisor.restarts=preloaded``) execs the ordinary command instead: a
cold start, same pid.
"""

import json
import os
import signal
import socket
import sys

# What a launcher sends a rank: stop (TERM, INT, HUP, QUIT), resume (CONT), and the user signals.
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCONT, signal.SIGUSR1,
           signal.SIGUSR2)


def cold(config):
    os.execv(sys.executable, [sys.executable, "-u", "-m", "resilience.rank", config])


def main(zygote, config):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + zygote)
        request = {"args": [config], "cwd": os.getcwd(), "env": dict(os.environ), "stub": os.getpid(),
                   "launcher": os.getppid()}
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        reply = sock.recv(4096)
    except OSError:  # no zygote listening (it served the first attempt, or failed): start cold
        reply = b""
    if not reply:
        sock.close()
        cold(config)
    pid = json.loads(reply)["pid"]

    def relay(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in RELAYED:
        signal.signal(signum, relay)
    reply = sock.recv(4096)
    if not reply:  # the zygote died before the rank (with the supervisor): the rank cleans up and dies of it
        os._exit(1)
    code = os.waitstatus_to_exitcode(json.loads(reply)["status"])
    if code < 0:  # killed: the agent must see the same signal (process_exit names it)
        if -code != signal.SIGKILL:  # SIGKILL has no handler to reset, and cannot be blocked
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
