"""Schema changes as named, ordered migrations. Append new ones; never edit an applied one."""

MIGRATIONS: list[tuple[str, str]] = [
    ("0001_runs_events_metrics", """
        CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            name TEXT,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            status TEXT NOT NULL,
            model TEXT,
            method TEXT,
            job_hash TEXT,
            job_toml TEXT,
            step INTEGER NOT NULL DEFAULT 0,
            total_steps INTEGER,
            loss REAL,
            pid INTEGER,
            segment INTEGER NOT NULL DEFAULT 0
        );
        CREATE TABLE events (
            seq INTEGER PRIMARY KEY,
            run_id TEXT,
            time REAL NOT NULL,
            kind TEXT NOT NULL,
            data TEXT NOT NULL,
            prev_hash TEXT NOT NULL,
            hash TEXT NOT NULL
        );
        CREATE INDEX events_run ON events(run_id, seq);
        CREATE TABLE chain_head (id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL);
        CREATE TABLE metrics (
            run_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            step INTEGER NOT NULL,
            segment INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (run_id, kind, step)
        );
        CREATE TABLE provenance (
            run_id TEXT NOT NULL,
            segment INTEGER NOT NULL,
            time REAL NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (run_id, segment)
        );
    """),
    ("0002_managed_runs_and_queue", """
        ALTER TABLE runs ADD COLUMN managed INTEGER NOT NULL DEFAULT 0;
        CREATE TABLE queue (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL,
            job_path TEXT NOT NULL,
            job_toml TEXT NOT NULL,
            priority INTEGER NOT NULL DEFAULT 0,
            added REAL NOT NULL,
            state TEXT NOT NULL,
            run_id TEXT
        );
    """),
    ("0003_datasets", """
        CREATE TABLE datasets (
            name TEXT PRIMARY KEY,
            path TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            size INTEGER NOT NULL,
            lines INTEGER NOT NULL,
            license TEXT NOT NULL,
            owner TEXT NOT NULL,
            may_train INTEGER NOT NULL DEFAULT 1,
            may_leave INTEGER NOT NULL DEFAULT 0,
            targets TEXT NOT NULL DEFAULT '[]',
            added REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE INDEX datasets_sha256 ON datasets(sha256);
        CREATE INDEX datasets_path ON datasets(path);
    """),
    ("0004_remote_runs", """
        ALTER TABLE runs ADD COLUMN target TEXT;
        ALTER TABLE runs ADD COLUMN remote_job_id TEXT;
        ALTER TABLE runs ADD COLUMN remote TEXT;
        ALTER TABLE runs ADD COLUMN remote_seq INTEGER NOT NULL DEFAULT 0;
    """),
    ("0005_every_record_chained", """
        ALTER TABLE queue ADD COLUMN agent_pid INTEGER;
        ALTER TABLE queue ADD COLUMN starting_at REAL;
        CREATE INDEX events_kind ON events(kind, seq);
        CREATE TABLE chain_records (id INTEGER PRIMARY KEY CHECK (id = 1), since_seq INTEGER NOT NULL);
        INSERT INTO chain_records SELECT 1, COALESCE(MAX(seq), 0) FROM events
    """),
    ("0006_dataset_may_federate", """
        ALTER TABLE datasets ADD COLUMN may_federate INTEGER NOT NULL DEFAULT 0;
    """),
    ("0007_remote_event_log", """
        ALTER TABLE runs ADD COLUMN remote_log_hash TEXT;
    """),
]
