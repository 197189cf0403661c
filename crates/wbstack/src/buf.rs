//! Page-aligned IO buffers, usable for O_DIRECT.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every IO buffer: one page, which satisfies O_DIRECT on any logical
/// block size up to 4 KiB.
pub const IO_ALIGN: usize = 4096;

/// An owned, zero-initialised, 4 KiB-aligned byte buffer.
pub struct IoBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: IoBuf uniquely owns its allocation (like Vec<u8>), so moving it to or sharing
// `&IoBuf` with another thread is as safe as for Vec<u8>.
unsafe impl Send for IoBuf {}
// SAFETY: as above; `&IoBuf` only gives read access.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1).next_multiple_of(IO_ALIGN), IO_ALIGN)
            .expect("IoBuf layout")
    }

    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> IoBuf {
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size (len.max(1) rounded up to 4096).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        IoBuf { ptr, len }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> IoBuf {
        let mut b = IoBuf::zeroed(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of at least `len` initialised (zeroed) bytes,
        // owned by self; the shared borrow of self prevents concurrent mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; the unique borrow of self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in `zeroed` with exactly this layout (len unchanged).
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl Clone for IoBuf {
    fn clone(&self) -> Self {
        IoBuf::from_slice(self.as_slice())
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        for len in [0usize, 1, 512, 4096, 4097, 1 << 20] {
            let mut b = IoBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as u8);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
        }
    }
}
