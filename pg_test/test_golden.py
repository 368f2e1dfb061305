"""The public SQL API as a golden file, as pg_graphql and pgmq keep theirs:
psql runs golden/api.sql against a fresh cluster the way pg_regress runs its
files (statements echoed, errors as their SQLSTATE, each case in BEGIN ...
ROLLBACK), and its output must equal golden/api.out."""
import difflib
import os
import subprocess
from pathlib import Path

import pytest

from conftest import PGBIN, fresh_cluster

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2")
    yield cluster
    cluster.stop()


def psql_output(pg, script):
    """What psql prints running `script` from its standard input (as
    pg_regress runs a file: no file names or line numbers in its errors)."""
    env = dict(os.environ, PGTZ="UTC", PGDATESTYLE="ISO, MDY", PGOPTIONS="-c intervalstyle=postgres")
    with open(script) as sql:
        done = subprocess.run([f"{PGBIN}/psql", "-X", "-a", "-q", "-h", pg.dir, "-p", str(pg.port), "-U", "postgres",
                               "-d", "postgres"], stdin=sql, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=300)
    return done.stdout.decode()


def test_the_public_api_answers_as_its_golden_file_says(pg, tmp_path):
    out = psql_output(pg, GOLDEN / "api.sql")
    # (kept: a change of the API that is meant is accepted by copying it over golden/api.out)
    (tmp_path / "api.out").write_text(out)
    expected = (GOLDEN / "api.out").read_text()
    if out != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), out.splitlines(keepends=True),
                                            "golden/api.out (expected)", "psql's output"))
        pytest.fail(f"golden/api.sql printed something else than golden/api.out"
                    f" (its whole output: {tmp_path / 'api.out'}):\n{diff}", pytrace=False)
