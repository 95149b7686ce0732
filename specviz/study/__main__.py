from specviz.study.runner import main

raise SystemExit(main())
