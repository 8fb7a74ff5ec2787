#!/usr/bin/env python3
"""Re-creates bench/pride_and_prejudice.txt from Debian's r-cran-janeaustenr package.

usage: apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg
       bench/extract_janeaustenr.py pkg > bench/pride_and_prejudice.txt

The package keeps each novel as an R character vector (one element per line) in a
lazy-load database: blobs of [4-byte length][zlib stream], each an XDR-serialized
STRSXP. Only the standard library; no R needed.
"""
import struct
import sys
import zlib

BOOK = "PRIDE AND PREJUDICE"


def blobs(data):
    pos = 0
    while pos < len(data):
        d = zlib.decompressobj()
        out = d.decompress(data[pos + 4:])
        yield out
        pos = len(data) - len(d.unused_data)


def lines(blob):
    assert blob[:2] == b"X\n", "not an XDR serialization"
    version, = struct.unpack(">i", blob[2:6])
    pos = 14
    if version == 3:
        n, = struct.unpack(">i", blob[pos:pos + 4])
        pos += 4 + n
    flags, n = struct.unpack(">ii", blob[pos:pos + 8])
    pos += 8
    assert flags & 0xFF == 16, "not a character vector"
    out = []
    for _ in range(n):
        flags, length = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        assert flags & 0xFF == 9, "not a string"
        out.append("" if length < 0 else blob[pos:pos + length].decode("utf-8"))
        pos += max(length, 0)
    return out


def main():
    rdb = f"{sys.argv[1]}/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    with open(rdb, "rb") as f:
        data = f.read()
    for blob in blobs(data):
        book = lines(blob)
        if book and book[0] == BOOK:
            sys.stdout.write("\n".join(book) + "\n")
            return
    sys.exit(f"{BOOK} not found in {rdb}")


if __name__ == "__main__":
    main()
