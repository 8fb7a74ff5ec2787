//! Times the tensor-data digest (`Gguf::data_digest`), which `ds4` computes once
//! per model file and caches by the file's identity.
//!
//! ```text
//! cargo run --release -p ds4-gguf --example digest -- FILE [CACHE_DIR]
//! cargo run --release -p ds4-gguf --example digest -- --write FILE GIB
//! ```
//!
//! The first form prints the digest, whether it came from the cache, and the
//! time to open the file and get it. `--write` makes a synthetic GGUF of `GIB`
//! GiB of tensor data (zeros, which cost no memory until written) to time a
//! large file without one at hand.

use std::path::PathBuf;
use std::time::Instant;

use ds4_gguf::{DigestEvent, DigestOptions, GgmlType, Gguf, GgufWriter, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, file, gib] if flag == "--write" => {
            let gib: u64 = gib.parse()?;
            let mut w = GgufWriter::new();
            w.add_kv("general.architecture", Value::String("synthetic".into()));
            const TENSOR: u64 = 256 << 20;
            for i in 0..gib * 4 {
                w.add_tensor(
                    format!("t{i}"),
                    &[TENSOR],
                    GgmlType::I8,
                    vec![0; TENSOR as usize],
                )?;
            }
            w.write_to(file)?;
            println!("wrote {file}: {gib} GiB of tensor data");
        }
        [file, rest @ ..] if rest.len() <= 1 => {
            let events = |e: DigestEvent<'_>| match e {
                DigestEvent::Cached => println!("from the cache"),
                DigestEvent::Hashed { bytes, seconds } => println!(
                    "hashed {:.2} GiB in {seconds:.3} s ({:.2} GiB/s)",
                    bytes as f64 / (1u64 << 30) as f64,
                    bytes as f64 / (1u64 << 30) as f64 / seconds.max(1e-9)
                ),
                DigestEvent::CacheFailed(e) => println!("cache not used: {e}"),
                DigestEvent::Progress { .. } => {}
            };
            let opts = DigestOptions {
                cache_dir: rest.first().map(PathBuf::from),
                events: &events,
                ..DigestOptions::default()
            };
            let t = Instant::now();
            let digest = Gguf::open(file)?.data_digest(&opts);
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            println!(
                "{hex}  open + digest {:.3} s, {} threads",
                t.elapsed().as_secs_f64(),
                opts.threads
            );
        }
        _ => return Err("usage: digest FILE [CACHE_DIR] | digest --write FILE GIB".into()),
    }
    Ok(())
}
