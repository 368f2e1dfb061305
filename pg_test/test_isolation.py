"""Multi-session schedules, as pgmq keeps them: PostgreSQL's isolation
tester (pg_isolation_regress, isolationtester) runs each spec in
isolation/specs/ against a fresh cluster, every permutation it lists step by
step across its sessions (a step that waits for a lock shows as
<waiting ...>), and the output must equal isolation/expected/."""
import subprocess
from pathlib import Path

import pytest

from conftest import fresh_cluster

ISOLATION = Path(__file__).resolve().parent / "isolation"
REGRESS = "/usr/lib/postgresql/15/lib/pgxs/src/test/isolation/pg_isolation_regress"
SPECS = sorted(p.stem for p in (ISOLATION / "specs").glob("*.spec"))


@pytest.fixture(scope="module")
def pg():
    # (held claims need worker 0, in the database the specs run in)
    cluster = fresh_cluster("flow.workers = 1")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("spec", SPECS)
def test_isolation_spec(pg, spec, tmp_path):
    """claim_vs_cancel: an external held claim in an open transaction against
    flow.cancel of its run (the claim's transaction commits a completion, or
    rolls back, or the cancel comes first)."""
    done = subprocess.run([REGRESS, "--use-existing", "--dbname=postgres", f"--host={pg.dir}", f"--port={pg.port}",
                           "--user=postgres", f"--inputdir={ISOLATION}", f"--outputdir={tmp_path}", spec],
                          capture_output=True, text=True, timeout=300)
    diffs = tmp_path / "regression.diffs"
    assert done.returncode == 0, (diffs.read_text() if diffs.exists() else "") + done.stdout + done.stderr
