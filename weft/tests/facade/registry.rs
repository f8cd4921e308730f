//! Spec parsing, the list of known backends, and opening the built-in
//! simulated fabrics through the registry.

#![cfg(feature = "loopback")]

use weft::{
    Availability, LibfabricOptions, LoopbackOptions, LoopbackProfile, ProviderConfig,
    ProviderError, ProviderSpec, Registry,
};

#[test]
fn specs_parse_and_round_trip() {
    let cases = [
        ("loopback", ProviderSpec::Loopback),
        ("loopback-null", ProviderSpec::LoopbackNull),
        ("libfabric:tcp", ProviderSpec::Libfabric("tcp".into())),
        ("libfabric:shm", ProviderSpec::Libfabric("shm".into())),
        ("libfabric:efa", ProviderSpec::Libfabric("efa".into())),
        ("verbs", ProviderSpec::Verbs(None)),
        ("verbs:mlx5_0", ProviderSpec::Verbs(Some("mlx5_0".into()))),
    ];
    for (s, want) in cases {
        let got: ProviderSpec = s.parse().unwrap();
        assert_eq!(got, want, "{s}");
        assert_eq!(got.to_string(), s);
    }
    assert_eq!(
        " null ".parse::<ProviderSpec>().unwrap(),
        ProviderSpec::LoopbackNull
    );
    assert!(ProviderSpec::Loopback.is_loopback());
    assert!(!ProviderSpec::Verbs(None).is_loopback());
    assert_eq!(ProviderSpec::Libfabric("efa".into()).name(), "libfabric");
    assert_eq!(ProviderSpec::Libfabric("efa".into()).arg(), Some("efa"));
}

#[test]
fn malformed_specs_are_rejected_with_the_known_list() {
    for s in ["libfabric", "libfabric:", "verbs:", "loopback:1"] {
        assert!(
            matches!(
                s.parse::<ProviderSpec>(),
                Err(ProviderError::Invalid { .. })
            ),
            "{s}"
        );
    }
    let e = "rdma".parse::<ProviderSpec>().unwrap_err();
    let ProviderError::Unknown { known, .. } = &e else {
        panic!("{e:?}")
    };
    for k in [
        "loopback",
        "loopback-null",
        "libfabric:tcp",
        "libfabric:shm",
        "libfabric:efa",
        "libfabric:<provider>",
        "verbs",
        "verbs:<device>",
    ] {
        assert!(known.iter().any(|x| x == k), "{k} missing from {known:?}");
    }
    assert!(e.to_string().contains("libfabric:efa"), "{e}");
    assert!(matches!(
        Registry::empty().parse("mine"),
        Err(ProviderError::Unknown { known, .. }) if known.is_empty()
    ));
}

#[test]
fn loopback_hosts_share_one_fabric() {
    let cfg = ProviderConfig::default()
        .with_nics(2)
        .with_loopback(LoopbackOptions::new(LoopbackProfile::Ideal, 1).with_max_write_len(4096));
    let b = weft::provider_with(&ProviderSpec::Loopback, &cfg).unwrap();
    assert_eq!(b.spec(), &ProviderSpec::Loopback);
    let (h1, h2) = (b.host().unwrap(), b.host_with(1).unwrap());
    assert_eq!(h1.nics().unwrap().len(), 2);
    assert_eq!(h2.nics().unwrap().len(), 1);
    let d = h1.open(0).unwrap();
    assert_eq!(d.capabilities().max_write_len, 4096);
    assert_eq!(b.probe().unwrap().len(), 2);
    let fabric = b.loopback_fabric().expect("loopback backend has a fabric");
    assert_eq!(fabric.stats().writes_posted, 0);
}

#[test]
fn too_few_nics_is_reported_by_probe() {
    // verbs is the one backend whose NIC count this host decides; with no
    // RDMA device (or no rdma-core) it is unavailable either way.
    let cfg = ProviderConfig::default().with_nics(64);
    let b = weft::provider_with(&ProviderSpec::Verbs(None), &cfg).unwrap();
    assert!(b.probe().is_err());
}

#[test]
fn providers_lists_every_builtin_and_says_why_not() {
    let listed = weft::providers();
    let specs: Vec<&str> = listed.iter().map(|s| s.spec.as_str()).collect();
    for want in [
        "loopback",
        "loopback-null",
        "libfabric:tcp",
        "libfabric:shm",
        "libfabric:efa",
        "verbs",
    ] {
        assert!(specs.contains(&want), "{want} not in {specs:?}");
    }
    for s in &listed {
        if s.spec.starts_with("loopback") {
            assert!(
                s.availability.is_available(),
                "{}: {}",
                s.spec,
                s.availability
            );
        }
        if let Availability::Failed { reason } = &s.availability {
            assert!(!reason.is_empty());
        }
    }
}

#[test]
fn same_machine_libfabric_domains() {
    let d = |p: &str| LibfabricOptions::same_machine(p).domain;
    assert_eq!(d("tcp").as_deref(), Some("lo"));
    assert_eq!(d("shm").as_deref(), Some("shm"));
    assert_eq!(d("efa"), None);
}

#[test]
fn libfabric_options_reach_the_backend_or_it_says_why_not() {
    let cfg = ProviderConfig::default().with_libfabric(
        LibfabricOptions::default()
            .with_domain("no-such-interface")
            .with_max_inflight(8),
    );
    let b = weft::provider_with(&"libfabric:tcp".parse().unwrap(), &cfg).unwrap();
    // Either libfabric is absent here, or tcp has no such domain: both are
    // reported as errors naming the spec, never a panic.
    let Err(e) = b.host() else {
        panic!("libfabric:tcp opened a domain named no-such-interface")
    };
    assert!(e.to_string().starts_with("provider libfabric:tcp"), "{e}");
}
