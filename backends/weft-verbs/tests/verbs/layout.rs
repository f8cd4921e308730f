//! The verbs FFI (`weft_verbs::ffi::abi`, plus the verbs.h values in
//! `weft_verbs::ops`) against rdma-core's installed `<infiniband/verbs.h>`.
//!
//! The table below is the one list of what is checked: for every
//! `#[repr(C)]` mirror its size, its alignment, and the offset and size of
//! every field it names; then every numeric constant and enum value weft
//! takes from verbs.h. The test writes a C program printing the C side of
//! each entry, compiles it with the system C compiler (`$CC`, else `cc`),
//! runs it and compares. Without a compiler or the header it skips with a
//! message, unless `WEFT_REQUIRE_VERBS_HEADERS=1` (then it fails).
//!
//! Size rules, per struct (named in the table):
//! - `whole`: weft mirrors every C field (reserved `_…` arrays standing
//!   for unused ones): size must be equal;
//! - `head`: weft mirrors the leading fields of a struct the library
//!   allocates and weft only reads through a pointer: size at most C's;
//! - `out`: a buffer the library writes into: size at least C's.
//!
//! Alignment must be equal everywhere, as must every named field's offset
//! and size, and every constant.

use std::mem::{align_of, offset_of, size_of};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;
use weft_verbs::ffi::abi::*;
use weft_verbs::ops::{access, mtu_bytes, WcStatus, GRH_LEN, GRH_SGID, PORT_ACTIVE};

/// How weft's value must relate to the C one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    Eq,
    AtMost,
    AtLeast,
}

impl Rule {
    fn holds(self, rust: i128, c: i128) -> bool {
        match self {
            Rule::Eq => rust == c,
            Rule::AtMost => rust <= c,
            Rule::AtLeast => rust >= c,
        }
    }

    fn says(self) -> &'static str {
        match self {
            Rule::Eq => "must be equal",
            Rule::AtMost => "must be at most the C value: weft mirrors a head",
            Rule::AtLeast => "must be at least the C value: the library writes into it",
        }
    }
}

/// What a check is about (for the summary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    StructSize,
    StructAlign,
    FieldOffset,
    FieldSize,
    Constant,
}

/// One value computed on both sides.
#[derive(Clone, Debug)]
struct Check {
    what: What,
    /// Names the C item, e.g. `offsetof(struct ibv_wc, imm_data)`.
    label: String,
    /// The C expression printed by the generated program.
    c_expr: String,
    /// The Rust item compared with it.
    rust_name: String,
    rust: i128,
    rule: Rule,
}

fn num<T: TryInto<i128>>(v: T) -> i128
where
    T::Error: std::fmt::Debug,
{
    v.try_into().expect("value fits i128")
}

/// The size of the field `get` borrows (never called).
fn field_size<T, F>(_get: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// The `enum ibv_mtu` code weft maps to `bytes` (inverse of `mtu_bytes`).
fn mtu_code(bytes: u32) -> u32 {
    (0..64)
        .find(|c| mtu_bytes(*c) == Some(bytes))
        .unwrap_or(u32::MAX)
}

/// A struct's size rule.
#[allow(non_upper_case_globals)]
mod kind {
    use super::Rule;
    pub const whole: Rule = Rule::Eq;
    pub const head: Rule = Rule::AtMost;
    pub const out: Rule = Rule::AtLeast;
}

macro_rules! c_field {
    ($f:ident) => {
        stringify!($f)
    };
    ($f:ident, $cf:literal) => {
        $cf
    };
}

/// `Rust = "c_struct" rule { field, field = "c.member", ... };`
macro_rules! structs {
    ($($rust:ident = $c:literal $kind:ident { $($f:ident $(= $cf:literal)?),* $(,)? };)*) => {{
        let mut v = Vec::new();
        $(
            let ty = concat!("struct ", $c);
            let r = stringify!($rust);
            v.push(Check::new(What::StructSize, format!("sizeof({ty})"), r, size_of::<$rust>(), kind::$kind));
            v.push(Check::new(What::StructAlign, format!("_Alignof({ty})"), r, align_of::<$rust>(), Rule::Eq));
            $(
                let cf = c_field!($f $(, $cf)?);
                let rf = concat!(stringify!($rust), "::", stringify!($f));
                v.push(Check::new(What::FieldOffset, format!("offsetof({ty}, {cf})"), rf, offset_of!($rust, $f), Rule::Eq));
                v.push(
                    Check::new(What::FieldSize, format!("sizeof({ty}.{cf})"), rf, field_size(|s: &$rust| &s.$f), Rule::Eq)
                        .expr(format!("sizeof((({ty} *)0)->{cf})")),
                );
            )*
        )*
        v
    }};
}

/// `"c_struct", "c.member" => base offset in Rust, byte range;`: a member
/// weft writes into a byte array at a fixed range.
macro_rules! members {
    ($($c:literal, $cf:literal => $base:expr, $range:expr;)*) => {{
        let mut v = Vec::new();
        $(
            let ty = concat!("struct ", $c);
            let range: Range<usize> = $range;
            let rf = concat!(stringify!($range), " (from ", stringify!($base), ")");
            v.push(Check::new(What::FieldOffset, format!("offsetof({ty}, {})", $cf), rf, $base + range.start, Rule::Eq));
            v.push(
                Check::new(What::FieldSize, format!("sizeof({ty}.{})", $cf), rf, range.len(), Rule::Eq)
                    .expr(format!("sizeof((({ty} *)0)->{})", $cf)),
            );
        )*
        v
    }};
}

/// `"C expression" => Rust value,`
macro_rules! constants {
    ($($c:literal => $rust:expr,)*) => {
        vec![$(Check::new(What::Constant, $c.to_string(), stringify!($rust), $rust, Rule::Eq)),*]
    };
}

impl Check {
    fn new<T: TryInto<i128>>(
        what: What,
        label: String,
        rust_name: &str,
        rust: T,
        rule: Rule,
    ) -> Self
    where
        T::Error: std::fmt::Debug,
    {
        Check {
            what,
            c_expr: label.clone(),
            label,
            rust_name: rust_name.to_string(),
            rust: num(rust),
            rule,
        }
    }

    fn expr(mut self, c_expr: String) -> Self {
        self.c_expr = c_expr;
        self
    }
}

/// Everything weft's verbs FFI takes from verbs.h.
fn table() -> Vec<Check> {
    let mut v = structs! {
        IbvSge = "ibv_sge" whole { addr, length, lkey };
        IbvSendWr = "ibv_send_wr" whole {
            wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr, qp_type,
        };
        IbvRecvWr = "ibv_recv_wr" whole { wr_id, next, sg_list, num_sge };
        IbvWc = "ibv_wc" whole {
            wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags,
            pkey_index, slid, sl, dlid_path_bits,
        };
        IbvContextOps = "ibv_context_ops" whole { poll_cq, post_srq_recv, post_send, post_recv };
        IbvContext = "ibv_context" head { device, ops };
        IbvQp = "ibv_qp" head { context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num };
        IbvCq = "ibv_cq" head { context };
        IbvSrq = "ibv_srq" head { context };
        IbvMr = "ibv_mr" whole { context, pd, addr, length, handle, lkey, rkey };
        IbvQpCap = "ibv_qp_cap" whole {
            max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data,
        };
        IbvQpInitAttr = "ibv_qp_init_attr" whole {
            qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all,
        };
        IbvSrqInitAttr = "ibv_srq_init_attr" whole {
            srq_context, max_wr = "attr.max_wr", max_sge = "attr.max_sge",
            srq_limit = "attr.srq_limit",
        };
        IbvGlobalRoute = "ibv_global_route" whole {
            dgid, flow_label, sgid_index, hop_limit, traffic_class,
        };
        IbvAhAttr = "ibv_ah_attr" whole {
            grh, dlid, sl, src_path_bits, static_rate, is_global, port_num,
        };
        IbvQpAttr = "ibv_qp_attr" whole {
            qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn,
            dest_qp_num, qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index,
            alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic,
            max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry,
            alt_port_num, alt_timeout, rate_limit,
        };
        IbvPortAttr = "ibv_port_attr" out {
            state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz,
            bad_pkey_cntr, qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl,
            subnet_timeout, init_type_reply, active_width, active_speed, phys_state,
            link_layer, flags, port_cap_flags2,
        };
        IbvGidEntry = "ibv_gid_entry" whole { gid, gid_index, port_num, gid_type, ndev_ifindex };
    };
    let wr = offset_of!(IbvSendWr, wr);
    v.extend(members! {
        "ibv_send_wr", "wr.rdma.remote_addr" => wr, WR_RDMA_REMOTE_ADDR;
        "ibv_send_wr", "wr.rdma.rkey" => wr, WR_RDMA_RKEY;
        "ibv_send_wr", "wr.ud.ah" => wr, WR_UD_AH;
        "ibv_send_wr", "wr.ud.remote_qpn" => wr, WR_UD_REMOTE_QPN;
        "ibv_send_wr", "wr.ud.remote_qkey" => wr, WR_UD_REMOTE_QKEY;
        "ibv_grh", "sgid" => 0, GRH_SGID;
    });
    v.extend(constants! {
        "sizeof(struct ibv_grh)" => GRH_LEN,
        "IBV_QP_STATE" => QP_STATE,
        "IBV_QP_ACCESS_FLAGS" => QP_ACCESS_FLAGS,
        "IBV_QP_PKEY_INDEX" => QP_PKEY_INDEX,
        "IBV_QP_PORT" => QP_PORT,
        "IBV_QP_QKEY" => QP_QKEY,
        "IBV_QP_AV" => QP_AV,
        "IBV_QP_PATH_MTU" => QP_PATH_MTU,
        "IBV_QP_TIMEOUT" => QP_TIMEOUT,
        "IBV_QP_RETRY_CNT" => QP_RETRY_CNT,
        "IBV_QP_RNR_RETRY" => QP_RNR_RETRY,
        "IBV_QP_RQ_PSN" => QP_RQ_PSN,
        "IBV_QP_MAX_QP_RD_ATOMIC" => QP_MAX_QP_RD_ATOMIC,
        "IBV_QP_MIN_RNR_TIMER" => QP_MIN_RNR_TIMER,
        "IBV_QP_SQ_PSN" => QP_SQ_PSN,
        "IBV_QP_MAX_DEST_RD_ATOMIC" => QP_MAX_DEST_RD_ATOMIC,
        "IBV_QP_DEST_QPN" => QP_DEST_QPN,
        "IBV_QPS_RESET" => QPS_RESET,
        "IBV_QPS_INIT" => QPS_INIT,
        "IBV_QPS_RTR" => QPS_RTR,
        "IBV_QPS_RTS" => QPS_RTS,
        "IBV_QPS_ERR" => QPS_ERR,
        "IBV_QPT_RC" => QPT_RC,
        "IBV_QPT_UD" => QPT_UD,
        "IBV_WR_RDMA_WRITE" => WR_RDMA_WRITE,
        "IBV_WR_RDMA_WRITE_WITH_IMM" => WR_RDMA_WRITE_WITH_IMM,
        "IBV_WR_SEND" => WR_SEND,
        "IBV_SEND_SIGNALED" => SEND_SIGNALED,
        "IBV_WC_SEND" => WC_SEND,
        "IBV_WC_RDMA_WRITE" => WC_RDMA_WRITE,
        "IBV_WC_RECV" => WC_RECV,
        "IBV_WC_RECV_RDMA_WITH_IMM" => WC_RECV_RDMA_WITH_IMM,
        "IBV_WC_GRH" => WC_GRH,
        "IBV_WC_WITH_IMM" => WC_WITH_IMM,
        "IBV_ACCESS_OPTIONAL_RANGE" => ACCESS_OPTIONAL_RANGE,
        "IBV_ACCESS_LOCAL_WRITE" => access::LOCAL_WRITE,
        "IBV_ACCESS_REMOTE_WRITE" => access::REMOTE_WRITE,
        "IBV_ACCESS_REMOTE_READ" => access::REMOTE_READ,
        "IBV_ACCESS_RELAXED_ORDERING" => access::RELAXED_ORDERING,
        "IBV_LINK_LAYER_INFINIBAND" => LINK_LAYER_INFINIBAND,
        "IBV_LINK_LAYER_ETHERNET" => LINK_LAYER_ETHERNET,
        "IBV_GID_TYPE_IB" => GID_TYPE_IB,
        "IBV_GID_TYPE_ROCE_V1" => GID_TYPE_ROCE_V1,
        "IBV_GID_TYPE_ROCE_V2" => GID_TYPE_ROCE_V2,
        "IBV_PORT_ACTIVE" => PORT_ACTIVE,
        "IBV_MTU_256" => mtu_code(256),
        "IBV_MTU_512" => mtu_code(512),
        "IBV_MTU_1024" => mtu_code(1024),
        "IBV_MTU_2048" => mtu_code(2048),
        "IBV_MTU_4096" => mtu_code(4096),
        "IBV_WC_SUCCESS" => WcStatus::Success.raw(),
        "IBV_WC_LOC_LEN_ERR" => WcStatus::LocLenErr.raw(),
        "IBV_WC_LOC_QP_OP_ERR" => WcStatus::LocQpOpErr.raw(),
        "IBV_WC_LOC_PROT_ERR" => WcStatus::LocProtErr.raw(),
        "IBV_WC_WR_FLUSH_ERR" => WcStatus::WrFlushErr.raw(),
        "IBV_WC_LOC_ACCESS_ERR" => WcStatus::LocAccessErr.raw(),
        "IBV_WC_REM_INV_REQ_ERR" => WcStatus::RemInvReqErr.raw(),
        "IBV_WC_REM_ACCESS_ERR" => WcStatus::RemAccessErr.raw(),
        "IBV_WC_REM_OP_ERR" => WcStatus::RemOpErr.raw(),
        "IBV_WC_RETRY_EXC_ERR" => WcStatus::RetryExcErr.raw(),
        "IBV_WC_RNR_RETRY_EXC_ERR" => WcStatus::RnrRetryExcErr.raw(),
        "IBV_WC_FATAL_ERR" => WcStatus::FatalErr.raw(),
        "IBV_WC_GENERAL_ERR" => WcStatus::GeneralErr.raw(),
    });
    v
}

/// The C program printing `index value` for every check.
fn c_program(checks: &[Check]) -> String {
    let mut s = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\nint main(void)\n{\n",
    );
    for (i, c) in checks.iter().enumerate() {
        s += &format!("\tprintf(\"{i} %lld\\n\", (long long)({}));\n", c.c_expr);
    }
    s += "\treturn 0;\n}\n";
    s
}

/// Compares the C program's output with the table; one line per mismatch,
/// naming the C item, both values and the Rust item.
fn compare(checks: &[Check], c_output: &str) -> Vec<String> {
    let mut c_vals: Vec<Option<i128>> = vec![None; checks.len()];
    for line in c_output.lines() {
        let mut it = line.split_whitespace();
        let parsed = (|| {
            let i: usize = it.next()?.parse().ok()?;
            let v: i128 = it.next()?.parse().ok()?;
            Some((i, v))
        })();
        match parsed {
            Some((i, v)) if i < checks.len() => c_vals[i] = Some(v),
            _ => {
                return vec![format!(
                    "unreadable line in the C program's output: {line:?}"
                )]
            }
        }
    }
    checks
        .iter()
        .zip(c_vals)
        .filter_map(|(c, v)| match v {
            None => Some(format!("{}: no value from the C program", c.label)),
            Some(v) if c.rule.holds(c.rust, v) => None,
            Some(v) => Some(format!(
                "{}: verbs.h says {v}, weft's {} is {} ({})",
                c.label,
                c.rust_name,
                c.rust,
                c.rule.says()
            )),
        })
        .collect()
}

/// Why the check cannot run here (no compiler, no header).
fn skip_or_fail(why: String) {
    if std::env::var("WEFT_REQUIRE_VERBS_HEADERS").as_deref() == Ok("1") {
        panic!("WEFT_REQUIRE_VERBS_HEADERS=1 but {why}");
    }
    eprintln!(
        "SKIPPED verbs layout check: {why} (install a C compiler and libibverbs-dev; \
         set WEFT_REQUIRE_VERBS_HEADERS=1 to make this a failure)"
    );
}

/// A scratch directory under the target dir, removed afterwards unless the
/// test failed (then the generated program stays for a look).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("weft-verbs-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }
}

fn run_cc(cc: &str, args: &[&str], dir: &Path) -> Result<std::process::Output, String> {
    Command::new(cc)
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run the C compiler `{cc}`: {e}"))
}

#[test]
fn ffi_matches_installed_verbs_h() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let scratch = Scratch::new();
    let dir = &scratch.0;
    std::fs::write(
        dir.join("probe.c"),
        "#include <infiniband/verbs.h>\nint main(void) { return 0; }\n",
    )
    .unwrap();
    let probe = match run_cc(&cc, &["-fsyntax-only", "probe.c"], dir) {
        Ok(o) => o,
        Err(why) => return skip_or_fail(why),
    };
    if !probe.status.success() {
        return skip_or_fail(format!(
            "`{cc}` cannot include <infiniband/verbs.h>: {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }

    let checks = table();
    std::fs::write(dir.join("layout.c"), c_program(&checks)).unwrap();
    let build = run_cc(&cc, &["-std=gnu11", "-o", "layout", "layout.c"], dir).unwrap();
    assert!(
        build.status.success(),
        "the generated C program (in {}) does not compile against verbs.h:\n{}",
        dir.display(),
        String::from_utf8_lossy(&build.stderr)
    );
    let out = Command::new(dir.join("layout")).output().unwrap();
    assert!(out.status.success(), "the generated C program failed");
    let mismatches = compare(&checks, &String::from_utf8_lossy(&out.stdout));
    assert!(
        mismatches.is_empty(),
        "weft's verbs FFI differs from <infiniband/verbs.h> in {} of {} checks:\n  {}",
        mismatches.len(),
        checks.len(),
        mismatches.join("\n  ")
    );
    let count = |w: What| checks.iter().filter(|c| c.what == w).count();
    eprintln!(
        "verbs.h agrees: {} structs (size, alignment), {} field offsets and sizes, {} constants",
        count(What::StructSize),
        count(What::FieldOffset),
        count(What::Constant)
    );
}

/// The output a C program agreeing with every entry would print.
fn agreeing_output(checks: &[Check]) -> Vec<String> {
    checks
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{i} {}", c.rust))
        .collect()
}

fn index_of(checks: &[Check], label: &str) -> usize {
    checks
        .iter()
        .position(|c| c.label == label)
        .unwrap_or_else(|| panic!("{label} is not in the table"))
}

#[test]
fn comparison_reports_a_wrong_offset_naming_struct_and_field() {
    let checks = table();
    let mut out = agreeing_output(&checks);
    assert!(compare(&checks, &out.join("\n")).is_empty());

    let i = index_of(&checks, "offsetof(struct ibv_wc, imm_data)");
    out[i] = format!("{i} {}", checks[i].rust + 4);
    let m = compare(&checks, &out.join("\n"));
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(
        m[0].contains("struct ibv_wc") && m[0].contains("imm_data"),
        "{}",
        m[0]
    );
    assert!(m[0].contains("IbvWc::imm_data"), "{}", m[0]);
}

#[test]
fn comparison_applies_each_size_rule_and_checks_constants() {
    let checks = table();
    let mismatch_with = |label: &str, delta: i128| {
        let mut out = agreeing_output(&checks);
        let i = index_of(&checks, label);
        out[i] = format!("{i} {}", checks[i].rust + delta);
        compare(&checks, &out.join("\n"))
    };
    // whole: any difference; head: C smaller than weft's head; out: C
    // larger than weft's buffer.
    assert_eq!(mismatch_with("sizeof(struct ibv_mr)", 8).len(), 1);
    assert_eq!(mismatch_with("sizeof(struct ibv_mr)", -8).len(), 1);
    assert!(mismatch_with("sizeof(struct ibv_qp)", 100).is_empty());
    assert_eq!(mismatch_with("sizeof(struct ibv_qp)", -1).len(), 1);
    assert!(mismatch_with("sizeof(struct ibv_port_attr)", -4).is_empty());
    assert_eq!(mismatch_with("sizeof(struct ibv_port_attr)", 4).len(), 1);
    let m = mismatch_with("IBV_WC_RECV_RDMA_WITH_IMM", 1);
    assert!(
        m.len() == 1 && m[0].contains("WC_RECV_RDMA_WITH_IMM"),
        "{m:?}"
    );
    let m = mismatch_with("sizeof(struct ibv_send_wr.wr.rdma.rkey)", 4);
    assert!(m.len() == 1 && m[0].contains("WR_RDMA_RKEY"), "{m:?}");
    // A value the C program did not print is a mismatch too.
    let out = agreeing_output(&checks);
    let m = compare(&checks, &out[1..].join("\n"));
    assert!(
        m.len() == 1 && m[0].contains("sizeof(struct ibv_sge)"),
        "{m:?}"
    );
}

/// Every struct, named field and constant of `ffi/abi.rs` is in the table
/// (fields named `_…` stand for C fields weft does not use; the struct's
/// size check covers them).
#[test]
fn table_covers_every_abi_item() {
    let checks = table();
    let named = |name: &str| {
        checks.iter().any(|c| {
            c.rust_name
                .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == ':'))
                .any(|tok| tok == name)
        })
    };
    let mut missing = Vec::new();
    let mut current: Option<&str> = None;
    for line in include_str!("../../src/ffi/abi.rs").lines() {
        let word = |prefix: &str| {
            line.strip_prefix(prefix)
                .map(|r| r.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')))
                .and_then(|mut w| w.next())
        };
        if let Some(name) = word("pub struct ") {
            current = Some(name);
            if !named(name) {
                missing.push(name.to_string());
            }
        } else if line == "}" {
            current = None;
        } else if let (Some(st), Some(field)) = (current, word("    pub ")) {
            let item = format!("{st}::{field}");
            if !field.starts_with('_') && !named(&item) {
                missing.push(item);
            }
        } else if let Some(name) = word("pub const ") {
            if !named(name) {
                missing.push(name.to_string());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not checked against verbs.h: {missing:?}"
    );
}

#[test]
fn wc_status_from_raw_inverts_raw() {
    use WcStatus::*;
    for s in [
        Success,
        LocLenErr,
        LocQpOpErr,
        LocProtErr,
        WrFlushErr,
        LocAccessErr,
        RemInvReqErr,
        RemAccessErr,
        RemOpErr,
        RetryExcErr,
        RnrRetryExcErr,
        FatalErr,
        GeneralErr,
    ] {
        assert_eq!(WcStatus::from_raw(s.raw()), s);
    }
}
