"""Bring the loopback interface up in a new network namespace (`unshare -n` starts with it down), where iproute2's
`ip link set lo up` is not installed: the same ioctl (SIOCSIFFLAGS with IFF_UP | IFF_LOOPBACK | IFF_RUNNING)."""
import fcntl
import socket
import struct

SIOCSIFFLAGS, FLAGS = 0x8914, 0x1 | 0x8 | 0x40

if __name__ == "__main__":
    fcntl.ioctl(socket.socket(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", FLAGS))
