//! The attempt plans this gateway keeps per agent ([`AgentPlan`]), so that a submission resolves
//! its attempt 1 without reading them first. They are a hint, never the truth: `submit_task`
//! (migration 0008) checks in the same statement that the plan it is given is still the agent's
//! and stores nothing if not; the submission then reads the plan again.

use agentscope_store::first_attempt::AgentPlan;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use uuid::Uuid;

/// What the kept plans may take in all (their instructions and parameters, roughly); past it
/// they are all dropped and kept again as submissions read them.
const BUDGET_BYTES: usize = 8 << 20;

#[derive(Default, Clone)]
pub(crate) struct Plans(Arc<Mutex<Kept>>);

#[derive(Default)]
struct Kept {
    /// Each plan with its size as counted in `bytes`.
    by_agent: HashMap<(Uuid, Uuid), (Arc<AgentPlan>, usize)>,
    bytes: usize,
}

impl Kept {
    fn remove(&mut self, workspace: Uuid, agent: Uuid) {
        if let Some((_, n)) = self.by_agent.remove(&(workspace, agent)) {
            self.bytes -= n;
        }
    }
}

fn size(p: &AgentPlan) -> usize {
    256 + p.instructions.as_ref().map_or(0, String::len)
        + p.params.as_ref().map_or(0, |v| v.to_string().len())
}

impl Plans {
    /// The plan kept for `agent` of `workspace`, if any.
    pub(crate) fn get(&self, workspace: Uuid, agent: Uuid) -> Option<Arc<AgentPlan>> {
        let kept = self.0.lock().expect("plans");
        kept.by_agent
            .get(&(workspace, agent))
            .map(|(p, _)| p.clone())
    }

    /// Keeps `plan`, just read, for `agent` of `workspace`.
    pub(crate) fn keep(&self, workspace: Uuid, agent: Uuid, plan: Arc<AgentPlan>) {
        let n = size(&plan);
        let mut kept = self.0.lock().expect("plans");
        kept.remove(workspace, agent);
        if kept.bytes + n > BUDGET_BYTES {
            kept.by_agent.clear();
            kept.bytes = 0;
        }
        if n <= BUDGET_BYTES / 16 {
            kept.by_agent.insert((workspace, agent), (plan, n));
            kept.bytes += n;
        }
    }

    /// Forgets the plan of `agent` of `workspace` (found stale, or the agent not found).
    pub(crate) fn forget(&self, workspace: Uuid, agent: Uuid) {
        self.0.lock().expect("plans").remove(workspace, agent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(instructions: usize) -> Arc<AgentPlan> {
        Arc::new(AgentPlan {
            agent_version_id: Some(Uuid::now_v7()),
            instructions: Some("x".repeat(instructions)),
            version_provider: Some("command".into()),
            binding_id: None,
            pool_id: None,
            required_capabilities: None,
            profile_provider: None,
            params: None,
        })
    }

    #[test]
    fn plans_are_kept_per_workspace_and_agent_within_a_budget() {
        let plans = Plans::default();
        let (w1, w2, a) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let p = plan(10);
        plans.keep(w1, a, p.clone());
        assert_eq!(plans.get(w1, a), Some(p));
        assert_eq!(plans.get(w2, a), None, "another workspace's agent id");
        plans.forget(w1, a);
        assert_eq!(plans.get(w1, a), None);

        // Too big to keep at all.
        plans.keep(w1, a, plan(BUDGET_BYTES / 16 + 1));
        assert_eq!(plans.get(w1, a), None);

        // Past the budget, everything kept goes and the newest is kept.
        let mut agents = Vec::new();
        for _ in 0..17 {
            let agent = Uuid::now_v7();
            plans.keep(w1, agent, plan(BUDGET_BYTES / 16 - 512));
            agents.push(agent);
        }
        let kept = agents
            .iter()
            .filter(|a| plans.get(w1, **a).is_some())
            .count();
        assert!((1..=16).contains(&kept), "{kept} kept");
        assert!(plans.get(w1, agents[16]).is_some());
        assert!(plans.0.lock().unwrap().bytes <= BUDGET_BYTES);
    }
}
