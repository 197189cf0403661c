//! The filesystem's error type: one variant per errno a syscall-like API reports, each
//! with a message a person can act on.

use super::alloc::AllocError;
use super::format::FormatError;
use super::meta::MetaError;
use crate::block::BlkError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("{0}: no such file or directory")]
    NotFound(String),
    #[error("{0}: file exists")]
    Exists(String),
    #[error("{0}: not a directory")]
    NotDir(String),
    #[error("{0}: is a directory")]
    IsDir(String),
    #[error("{0}: directory not empty")]
    NotEmpty(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("{0}: file name too long")]
    NameTooLong(String),
    #[error("no space left on device")]
    NoSpace,
    #[error("input/output error")]
    Io,
    #[error("{0}: too many levels of symbolic links")]
    Loop(String),
    #[error("operation not permitted: {0}")]
    NotPermitted(String),
    #[error("bad file descriptor: {0}")]
    BadFd(String),
    #[error("operation not supported: {0}")]
    NotSupported(String),
    /// The journal could not be written: the filesystem stopped accepting changes so
    /// nothing is half-applied on disk (ext4's errors=remount-ro).
    #[error("read-only filesystem: shut down after {0}")]
    ReadOnly(String),
    #[error("{0}: permission denied")]
    Access(String),
    #[error("{0}: no such attribute")]
    NoData(String),
    #[error("{0}: argument list too long")]
    TooBig(String),
    #[error("{0}: too many links")]
    TooManyLinks(String),
    #[error("no data or hole past the end of the file")]
    NoSuchOffset,
    #[error("{0}: device or resource busy")]
    Busy(String),
    #[error("filesystem is corrupt: {0}; run `wbstack fsck`")]
    Corrupt(String),
    /// Mount or fsck could not read the image.
    #[error("{0}")]
    Format(#[from] FormatError),
}

impl FsError {
    /// The errno value a POSIX API (and the FUSE front end) reports.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound(_) => libc::ENOENT,
            FsError::Exists(_) => libc::EEXIST,
            FsError::NotDir(_) => libc::ENOTDIR,
            FsError::IsDir(_) => libc::EISDIR,
            FsError::NotEmpty(_) => libc::ENOTEMPTY,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::NameTooLong(_) => libc::ENAMETOOLONG,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Io => libc::EIO,
            FsError::Loop(_) => libc::ELOOP,
            FsError::NotPermitted(_) => libc::EPERM,
            FsError::BadFd(_) => libc::EBADF,
            FsError::NotSupported(_) => libc::EOPNOTSUPP,
            FsError::ReadOnly(_) => libc::EROFS,
            FsError::Access(_) => libc::EACCES,
            FsError::NoData(_) => libc::ENODATA,
            FsError::TooBig(_) => libc::E2BIG,
            FsError::TooManyLinks(_) => libc::EMLINK,
            FsError::Busy(_) => libc::EBUSY,
            FsError::NoSuchOffset => libc::ENXIO,
            FsError::Corrupt(_) | FsError::Format(_) => libc::EUCLEAN,
        }
    }

    /// As a std::io::Error carrying the same errno (for callers speaking std::io).
    pub fn to_io(&self) -> std::io::Error {
        std::io::Error::new(
            std::io::Error::from_raw_os_error(self.errno()).kind(),
            self.to_string(),
        )
    }
}

impl From<BlkError> for FsError {
    fn from(e: BlkError) -> Self {
        match e {
            BlkError::Io | BlkError::PowerLoss => FsError::Io,
            BlkError::NoSpace => FsError::NoSpace,
            BlkError::Invalid(m) => FsError::Invalid(m),
            BlkError::NotSupported(m) => FsError::NotSupported(m),
        }
    }
}

impl From<MetaError> for FsError {
    fn from(e: MetaError) -> Self {
        FsError::Corrupt(e.0)
    }
}

impl From<AllocError> for FsError {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::NoSpace => FsError::NoSpace,
            AllocError::Corrupt(m) => FsError::Corrupt(m),
            AllocError::Invalid(m) => FsError::Invalid(m),
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;
