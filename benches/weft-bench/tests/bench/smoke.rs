//! Smoke test of the benchmark core in quick mode on loopback-null: checks
//! the output structure (rows present, JSON parses, CSV and SVG shaped
//! right), never timings.

use weft_bench::{BackendKind, Config, Status, Suite};

fn quick_all() -> weft_bench::Report {
    let mut cfg = Config::new(Suite::All, true);
    cfg.backends = vec![BackendKind::LoopbackNull];
    cfg.nics = Some(vec![1, 2]);
    cfg.rounds = Some(1);
    cfg.command = "smoke".into();
    weft_bench::run(&cfg)
}

#[test]
fn quick_all_on_loopback_null_has_every_row() {
    let rep = quick_all();
    let failed: Vec<_> = rep
        .rows
        .iter()
        .filter(|r| r.status != Status::Ok)
        .map(|r| format!("{} {} {:?}", r.bench, r.case, r.status))
        .collect();
    assert!(failed.is_empty(), "rows not measured: {failed:#?}");
    // The terminal table fits 100 columns.
    let table = rep.table();
    let wide: Vec<&str> = table.lines().filter(|l| l.chars().count() > 100).collect();
    assert!(wide.is_empty(), "table lines over 100 columns: {wide:#?}");
    let has = |bench: &str, case: &str, metric: &str, nics: usize| {
        rep.rows
            .iter()
            .filter(|r| r.bench == bench && r.case == case && r.metric == metric && r.nics == nics)
            .count()
    };
    let handoff = |bench: &str, case: &str, metric: &str, nics: usize| {
        rep.rows
            .iter()
            .filter(|r| {
                r.bench == bench
                    && r.case == case
                    && r.metric == metric
                    && r.nics == nics
                    && r.baseline_name == "raw behind a hand-off"
            })
            .count()
    };
    for nics in [1, 2] {
        // Quick plan: 3 sizes, 1 page size x 2 page counts; bandwidth and
        // page rate against the raw loop and the raw loop behind a
        // hand-off (page rate also behind a hand-off that carries the
        // page lists).
        assert_eq!(has("p2p", "single_write", "bandwidth", nics), 6);
        assert_eq!(handoff("p2p", "single_write", "bandwidth", nics), 3);
        assert_eq!(has("p2p", "single_write", "latency p50", nics), 3);
        assert_eq!(has("p2p", "paged_write", "page rate", nics), 6);
        assert_eq!(handoff("p2p", "paged_write", "page rate", nics), 2);
        assert_eq!(has("p2p", "paged_write", "bandwidth", nics), 2);
        // Back to back, and after 1 ms idle with the round armed before
        // or after the idle time.
        assert_eq!(has("p2p", "imm_only", "latency p50", nics), 3);
    }
    // Against the hand-off floor / raw posting, and against the raw
    // posting behind a hand-off.
    assert_eq!(has("proxy", "scatter", "submit->first WR p50", 1), 4);
    assert_eq!(has("proxy", "scatter", "submit->all posted p50", 1), 4);
    assert_eq!(handoff("proxy", "scatter", "submit->first WR p50", 1), 2);
    assert_eq!(handoff("proxy", "scatter", "submit->all posted p50", 1), 2);
    assert_eq!(has("proxy", "scatter", "submit call p50", 1), 2);
    // Against the raw loop on one thread and with the target on its own.
    assert_eq!(has("imm", "counter_throughput", "imm completions", 1), 2);
    // Reported through a callback (against the hand-off floor, the thread
    // wake-up floor, and the wake-up floor after the callback thread's own
    // idle time) and through a flag.
    assert_eq!(has("imm", "early_arrival", "arm->fire p50", 1), 4);
    // Each poll policy: latency after idleness and idle CPU.
    let n_pol = weft_bench::poll::policies().len();
    assert_eq!(has("poll", "submit_to_done_after_idle", "p50", 1), n_pol);
    assert_eq!(
        has("poll", "idle_cpu_per_group", "engine threads CPU", 1),
        n_pol
    );
    // Every weft row carries a baseline from the same run, and the
    // proxy/null-WR-rate targets are attached.
    for r in &rep.rows {
        let (Some(m), Some(b)) = (r.measured, r.baseline) else {
            panic!("row without measurement or baseline: {r:?}");
        };
        assert!(
            m.is_finite() && b.is_finite() && m >= 0.0 && b >= 0.0,
            "{r:?}"
        );
        assert!(!r.baseline_name.is_empty(), "{r:?}");
    }
    assert!(rep
        .rows
        .iter()
        .any(|r| r.bench == "proxy" && r.target.as_ref().is_some_and(|t| t.text.contains("0.5"))));
    // The breakdown has every stage for both peer counts.
    assert_eq!(rep.proxy_breakdown.len(), 2 * 10);
    assert!(rep.proxy_breakdown.iter().all(|b| b.n > 0));

    // JSON parses and holds the same rows.
    let v: serde_json::Value = serde_json::from_str(&rep.json()).expect("report JSON parses");
    assert_eq!(v["rows"].as_array().map(|a| a.len()), Some(rep.rows.len()));
    assert_eq!(v["rows"][0]["bench"], "p2p");
    assert_eq!(v["rows"][0]["status"]["state"], "ok");
    assert!(v["machine"].is_string());
    // CSV: header + one line per row, constant column count.
    let csv = rep.csv();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), rep.rows.len() + 1);
    assert!(lines[0].starts_with("bench,case,backend,nics,"));
    assert!(lines[0].ends_with(",placement"));
    // The rows that place threads say where they ran (`auto`: unpinned
    // below 8 CPUs, the roles' CPUs above).
    for r in rep
        .rows
        .iter()
        .filter(|r| ["p2p", "imm", "proxy"].contains(&r.bench.as_str()))
    {
        assert!(
            r.placement == "unpinned" || r.placement.starts_with("initiator "),
            "{r:?}"
        );
    }
    // SVG: one weft and one raw series per NIC count.
    let svg = rep.svg();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
    // Table: header + separator + rows (+ breakdown).
    let t = rep.table();
    assert!(t.lines().count() >= rep.rows.len() + 2);
    // Whether each target was met is in the table; its wording in the CSV.
    assert!(
        t.lines()
            .next()
            .is_some_and(|h| h.trim_end().ends_with("met")),
        "{t}"
    );
    assert!(rep
        .csv()
        .lines()
        .next()
        .is_some_and(|h| h.contains(",target,target_met,")));
}

/// `--pin` with an explicit list, at 8 NICs: every row measured and
/// labelled with the list's placement (CPUs repeat on hosts with fewer
/// than 5).
#[test]
fn quick_p2p_pinned_at_8_nics() {
    let allowed = weft_bench::pin::allowed_cpus();
    let cpus: Vec<usize> = (0..5).map(|i| allowed[i % allowed.len()]).collect();
    let mut cfg = Config::new(Suite::P2p, true);
    cfg.nics = Some(vec![8]);
    cfg.rounds = Some(1);
    cfg.pin = weft_bench::pin::PinMode::Cpus(cpus.clone());
    let rep = weft_bench::run(&cfg);
    let want = format!(
        "initiator {} target {} submitter {} tx-aux {} rx-aux {}",
        cpus[0], cpus[1], cpus[2], cpus[3], cpus[4]
    );
    assert!(!rep.rows.is_empty());
    for r in &rep.rows {
        assert_eq!(r.status, Status::Ok, "{r:?}");
        assert_eq!(r.nics, 8, "{r:?}");
        assert_eq!(r.placement, want, "{r:?}");
    }
    assert_eq!(
        rep.rows
            .iter()
            .filter(|r| r.case == "paged_write" && r.metric == "page rate")
            .count(),
        6
    );
    assert!(rep.table().contains(&format!(
        "threads of p2p on loopback-null, 8 NIC(s): {want}"
    )));
    // The bench thread got its own affinity back.
    assert_eq!(weft_bench::pin::allowed_cpus(), allowed);
}

#[test]
fn missing_backends_are_reported_not_failed() {
    let mut cfg = Config::new(Suite::Imm, true);
    cfg.backends = vec![BackendKind::Verbs(None)];
    cfg.rounds = Some(1);
    let rep = weft_bench::run(&cfg);
    assert!(!rep.rows.is_empty());
    // Without RDMA hardware (CI) the row says why; with it, it measures.
    for r in &rep.rows {
        assert!(
            matches!(r.status, Status::Unavailable(_) | Status::Ok),
            "{r:?}"
        );
    }
    // The reasons are wrapped to the table's width.
    let table = rep.table();
    assert!(table.lines().all(|l| l.chars().count() <= 100), "{table}");
}

#[test]
fn backend_names_parse() {
    for (s, k) in [
        ("loopback", BackendKind::Loopback),
        ("loopback-null", BackendKind::LoopbackNull),
        ("libfabric:tcp", BackendKind::Libfabric("tcp".into())),
        ("libfabric:efa", BackendKind::Libfabric("efa".into())),
        ("verbs", BackendKind::Verbs(None)),
        ("verbs:mlx5_0", BackendKind::Verbs(Some("mlx5_0".into()))),
    ] {
        assert_eq!(s.parse::<BackendKind>().ok().as_ref(), Some(&k));
        assert_eq!(k.to_string(), s);
    }
    assert!("libfabric:".parse::<BackendKind>().is_err());
    assert!("rdma".parse::<BackendKind>().is_err());
}

/// `proxy --quick` on libfabric:tcp: the scatter peers are extra tcp
/// endpoints in this process, progressed by the bench thread. Skipped (with
/// a message) where libfabric or its tcp provider is not installed.
#[test]
fn quick_proxy_on_libfabric_tcp() {
    let kind = BackendKind::Libfabric("tcp".into());
    if let Err(why) = weft_bench::Testbed::new(&kind, 1) {
        println!("skipped: libfabric:tcp unavailable here: {why}");
        return;
    }
    let mut cfg = Config::new(Suite::Proxy, true);
    cfg.backends = vec![kind];
    cfg.rounds = Some(1);
    cfg.command = "smoke".into();
    let rep = weft_bench::run(&cfg);
    let bad: Vec<_> = rep
        .rows
        .iter()
        .filter(|r| r.status != Status::Ok)
        .map(|r| format!("{} {:?}", r.param, r.status))
        .collect();
    assert!(bad.is_empty(), "proxy rows not measured: {bad:#?}");
    for peers in ["8 peers", "64 peers"] {
        let rows: Vec<_> = rep
            .rows
            .iter()
            .filter(|r| r.bench == "proxy" && r.param == peers)
            .collect();
        // 5 host-path rows and the submit call's own time (both APIs).
        assert_eq!(rows.len(), 6, "{peers}: {rows:#?}");
        assert_eq!(
            rows.iter()
                .filter(|r| r.metric == "submit call p50"
                    && r.baseline_name.starts_with("submit_scatter"))
                .count(),
            1,
            "{peers}: {rows:#?}"
        );
        for r in rows {
            assert_eq!(r.backend, "libfabric:tcp");
            assert!(
                r.measured.is_some_and(|m| m.is_finite() && m > 0.0),
                "{r:?}"
            );
            assert!(
                r.baseline.is_some_and(|b| b.is_finite() && b > 0.0),
                "{r:?}"
            );
        }
    }
    assert_eq!(rep.proxy_breakdown.len(), 2 * 10);
    assert!(rep.proxy_breakdown.iter().all(|b| b.n > 0));
}

#[test]
fn p2p_cases_select_rows() {
    let mut cfg = Config::new(Suite::P2p, true);
    cfg.nics = Some(vec![1]);
    cfg.rounds = Some(1);
    cfg.p2p_cases = Some(vec![weft_bench::p2p::Case::Paged]);
    let rep = weft_bench::run(&cfg);
    assert!(!rep.rows.is_empty());
    for r in &rep.rows {
        assert_eq!(r.status, Status::Ok, "{r:?}");
        assert_eq!(r.case, "paged_write", "{r:?}");
    }
}

#[test]
fn quick_pingpong_on_loopback_has_every_op_and_cpu_rows() {
    let mut cfg = Config::new(Suite::Pingpong, true);
    cfg.backends = vec![BackendKind::Loopback];
    cfg.rounds = Some(1);
    let rep = weft_bench::run(&cfg);
    let bad: Vec<_> = rep.rows.iter().filter(|r| r.status != Status::Ok).collect();
    assert!(bad.is_empty(), "{bad:#?}");
    for case in ["send_recv", "send_recv_polled", "write_imm"] {
        let n = rep
            .rows
            .iter()
            .filter(|r| r.bench == "pingpong" && r.case == case)
            .inspect(|r| assert!(r.measured.is_some_and(|m| m > 0.0), "{r:?}"))
            .count();
        assert_eq!(n, 2, "{case}: one row per quick size");
    }
    for case in ["cpu_per_gb", "cpu_per_mwr"] {
        assert!(
            rep.rows.iter().any(|r| r.case == case),
            "no {case} row: {:#?}",
            rep.rows
        );
    }
}
