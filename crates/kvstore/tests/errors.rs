//! I/O failures (disk full mid-payload, a failing rename, a vanished directory) return
//! an error the caller can log, leave no temp file behind, and leave the store usable.

mod common;

use std::fs;
use std::io::{self, Write};

use common::*;
use ds4_kvstore::{KvError, Payload, SaveOutcome, SaveReason, SaveRequest, Store};

fn stream_req<'a>(
    text: &'a [u8],
    write: &'a mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> SaveRequest<'a> {
    SaveRequest {
        text,
        payload: Payload::Stream {
            estimated_bytes: 100_000,
            write,
        },
        reason: SaveReason::Evict,
        tokens: 600,
        n_ctx: 4096,
        model: MODEL_A,
        ext_flags: 0,
        sections: &[],
    }
}

#[test]
fn disk_full_mid_payload() {
    let td = TempDir::new("enospc");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let text = vec![b't'; 2400];
    // The engine's writer fails after 64 KiB, as a full disk would.
    let mut failing = |w: &mut dyn Write| {
        w.write_all(&[1u8; 65536])?;
        Err(io::Error::from_raw_os_error(28)) // ENOSPC
    };
    let err = store.save(stream_req(&text, &mut failing)).unwrap_err();
    assert_eq!(err.io_kind(), Some(io::ErrorKind::StorageFull), "{err}");
    assert!(matches!(&err, KvError::Io { path, .. } if path.to_string_lossy().contains(".tmp.")));
    assert!(
        dir_names(&td.store_dir()).is_empty(),
        "temp file left behind"
    );
    // The store carries on.
    let mut ok = |w: &mut dyn Write| w.write_all(&[2u8; 1000]);
    assert!(matches!(
        store.save(stream_req(&text, &mut ok)).unwrap(),
        SaveOutcome::Saved { .. }
    ));
    let c = store.lookup(&text, &MODEL_A, 4096).unwrap().unwrap();
    assert_eq!(store.load(&c, &text).unwrap().payload, vec![2u8; 1000]);
}

#[test]
fn rename_failure_removes_temp() {
    let td = TempDir::new("rename");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let text = vec![b'r'; 700];
    // A non-empty directory squats the final name: rename(2) fails even for root.
    let squat = td.store_dir().join(ds4_kvstore::file_name_for(&text));
    fs::create_dir(&squat).unwrap();
    fs::write(squat.join("x"), b"x").unwrap();
    let err = store
        .save(SaveRequest {
            text: &text,
            payload: Payload::Bytes(&[3u8; 5000]),
            reason: SaveReason::Cold,
            tokens: 600,
            n_ctx: 4096,
            model: MODEL_A,
            ext_flags: 0,
            sections: &[],
        })
        .unwrap_err();
    assert!(
        matches!(&err, KvError::Io { op, .. } if op.contains("rename")),
        "{err}"
    );
    let names = dir_names(&td.store_dir());
    assert_eq!(
        names,
        vec![ds4_kvstore::file_name_for(&text)],
        "temp left: {names:?}"
    );
}

#[test]
fn directory_replaced_by_a_file() {
    let td = TempDir::new("gone");
    let dir = td.store_dir();
    let store = Store::open(&dir, big_config()).unwrap();
    save(&store, &Spec::new(&[b'g'; 600], b"p"));
    fs::remove_dir_all(&dir).unwrap();
    fs::write(&dir, b"now a file").unwrap();
    let text = vec![b'h'; 600];
    let err = store
        .save(SaveRequest {
            text: &text,
            payload: Payload::Bytes(b"payload"),
            reason: SaveReason::Cold,
            tokens: 600,
            n_ctx: 4096,
            model: MODEL_A,
            ext_flags: 0,
            sections: &[],
        })
        .unwrap_err();
    assert!(err.io_kind().is_some(), "{err}");
    assert!(store.lookup(&text, &MODEL_A, 4096).is_err());
    assert!(store.verify(false).is_err());
    // Opening under a file fails cleanly too.
    assert!(Store::open(dir.join("sub"), big_config()).is_err());
    assert!(Store::open(&dir, big_config()).is_err());
}

#[test]
fn unreadable_without_root() {
    use std::os::unix::fs::PermissionsExt;
    let td = TempDir::new("eacces");
    let dir = td.store_dir();
    let store = Store::open(&dir, big_config()).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o500)).unwrap();
    let probe = fs::write(dir.join("probe"), b"");
    if probe.is_ok() {
        // Running as root: permission bits do not stop writes; nothing to test here.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        return;
    }
    let err = store
        .save(SaveRequest {
            text: &[b'e'; 600],
            payload: Payload::Bytes(b"payload"),
            reason: SaveReason::Cold,
            tokens: 600,
            n_ctx: 4096,
            model: MODEL_A,
            ext_flags: 0,
            sections: &[],
        })
        .unwrap_err();
    assert_eq!(err.io_kind(), Some(io::ErrorKind::PermissionDenied));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    assert!(dir_names(&dir).is_empty());
}
