//! io_uring file device (placeholder until the timing model lands).
use super::{Completer, Device, DeviceSpec, Geometry, SpecError};
use crate::block::bio::Request;
use std::any::Any;

pub struct UringDevice {
    spec: String,
    geo: Geometry,
}

impl UringDevice {
    pub fn from_spec(spec: &DeviceSpec) -> Result<UringDevice, SpecError> {
        Err(spec.err("file devices are not built yet"))
    }
}

impl Device for UringDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn spec(&self) -> &str {
        &self.spec
    }
    fn queue_rq(&self, _rq: Request, _done: &Completer) {
        unimplemented!()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
